"""Mosaic TPU kernels over the chapter-sorted tiles of `dispatch`.

Grid (Hkv, tiles): the tile count is a dynamic grid bound (tiles in use, so the static worst case
costs no grid steps), the tile axis is innermost so a chapter's consecutive tiles map to the same K/V
block and the pipeline does not re-fetch it (the tile -> chapter table is scalar-prefetched into SMEM
and read by the K/V index_map). Only the Hkv axis is "parallel": the tile axis is dynamic (TPU interpret
mode requires such an axis to be "arbitrary", as megablox declares it) and the backward accumulates
dK/dV along it, so megacore chips split the work only when Hkv > 1.

Layouts (each block's last two dims are (multiple of 8, full) or (full, full), the Mosaic rule):
  q, dout, o, dq      [H, R, dh]     block (G, bp, dh)   head-major so a head's rows are a 2-D tile
  lse, lse_ref, D     [H, R, 1]      block (G, bp, 1)
  ls, vs              [R, 1]         block (bp, 1)       one column per row, broadcast over keys
  dls, dvs            [Hkv, R, 1]    block (None, bp, 1) summed over kv heads afterwards
  k, v, dk, dv        [C, Hkv, T, dh] block (None, None, T, dh): the caller's [C, T, Hkv, dh] would
                                     put Hkv second-minor, an illegal (1, dh) block when Hkv > 1
bp (`block_pairs`) must be a multiple of the dtype's sublane tiling (8 for 32-bit, 16 for bf16).
A chapter's T keys are one block, so T * dh must fit VMEM comfortably (T = 64 in practice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.routed_chapter_attention import dispatch
from kernels_pallas.routed_chapter_attention.dispatch import TN, matmul


def check_blocks(q_rows, k, block_pairs):
  """Raises ValueError if the TPU block shapes would be illegal for these inputs."""
  sublanes = 8 * max(1, 4 // jnp.dtype(q_rows.dtype).itemsize)
  if block_pairs % sublanes:
    raise ValueError(f"TPU block_pairs={block_pairs} must be a multiple of {sublanes} for {q_rows.dtype}")


def _heads_major(x):
  """[C, T, Hkv, dh] <-> [C, Hkv, T, dh]."""
  return x.transpose(0, 2, 1, 3)


def _chapter_map(j, i, info):
  return info[i] >> 1, j, 0, 0


def _fwd_kernel(info_ref, ls_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale):
  del info_ref
  a = ls_ref[...] * scale
  k, v = k_ref[...], v_ref[...]
  for g in range(q_ref.shape[0]):
    o_ref[g], lse_ref[g] = dispatch.attend(q_ref[g], k, v, a)


def forward(plan, q_rows, k, v, ls_rows, *, block_pairs, interpret):
  """Per-row attention to the row's chapter: (o [H, R, dh] normalised per row, lse [H, R, 1])."""
  h, r, dh = q_rows.shape
  _, t, hkv, _ = k.shape
  g, bp = h // hkv, block_pairs
  rows = lambda j, i, info: (j, i, 0)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(hkv, plan.num_tiles),
      in_specs=[
          pl.BlockSpec((bp, 1), lambda j, i, info: (i, 0)),
          pl.BlockSpec((g, bp, dh), rows),
          pl.BlockSpec((None, None, t, dh), _chapter_map),
          pl.BlockSpec((None, None, t, dh), _chapter_map),
      ],
      out_specs=[pl.BlockSpec((g, bp, dh), rows), pl.BlockSpec((g, bp, 1), rows)],
  )
  return pl.pallas_call(
      functools.partial(_fwd_kernel, scale=dh ** -0.5),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((h, r, dh), jnp.float32), jax.ShapeDtypeStruct((h, r, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="routed_chapter_attention_fwd",
  )(plan.tile_info, ls_rows, q_rows, _heads_major(k), _heads_major(v))


def _bwd_kernel(info_ref, ls_ref, vs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, *rest, scale, moe):
  """One tile, one kv head: dq/dls/dvs for the tile's rows, dK/dV added to the chapter's block.

  The dK/dV output block stays resident while consecutive tiles share a chapter (the tile axis is
  innermost and "arbitrary"); it is zeroed on the chapter's first tile.
  """
  d_ref = None if moe else rest[0]
  dq_ref, dls_ref, dvs_ref, dk_ref, dv_ref = rest[-5:]

  @pl.when((info_ref[pl.program_id(1)] & 1) == 1)
  def _():
    dk_ref[...] = jnp.zeros_like(dk_ref)
    dv_ref[...] = jnp.zeros_like(dv_ref)

  a, c = ls_ref[...] * scale, vs_ref[...]
  k, v = k_ref[...], v_ref[...]
  dls = dvs = jnp.zeros_like(a)
  dk = dv = jnp.zeros(dk_ref.shape, jnp.float32)
  for g in range(q_ref.shape[0]):
    q, do = q_ref[g], do_ref[g]
    qk, p, dov, dz = dispatch.probs_and_dz(q, k, v, do, a, c, lse_ref[g], None if moe else d_ref[g])
    dq_ref[g] = a * matmul(dz, k)
    dls += scale * jnp.sum(dz * qk, -1, keepdims=True)
    dvs += jnp.sum(p * dov, -1, keepdims=True)
    dk += matmul(dz * a, q, TN)
    dv += matmul(p.astype(do.dtype), (c * do).astype(do.dtype), TN)
  dls_ref[...] = dls
  dvs_ref[...] = dvs
  dk_ref[...] += dk
  dv_ref[...] += dv


def backward(plan, q_rows, k, v, ls_rows, vs_rows, do_rows, lse_rows, d_rows, *, block_pairs, interpret):
  """Returns dq_rows [H, R, dh], dls_rows [R], dvs_rows [R] and dk, dv [C, T, Hkv, dh] (float32).

  lse_rows: the token's joint LSE per row (joint) or the row's own lse (moe, then d_rows is None).
  Chapters no tile visits are never written: dK/dV alias a zeros buffer.
  """
  h, r, dh = q_rows.shape
  c, t, hkv, _ = k.shape
  g, bp, moe = h // hkv, block_pairs, d_rows is None
  rows = lambda j, i, info: (j, i, 0)
  col = pl.BlockSpec((bp, 1), lambda j, i, info: (i, 0))
  kv_block = pl.BlockSpec((None, None, t, dh), _chapter_map)
  head_rows = pl.BlockSpec((g, bp, dh), rows)
  head_col = pl.BlockSpec((g, bp, 1), rows)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  in_specs = [col, col, head_rows, kv_block, kv_block, head_rows, head_col] + ([] if moe else [head_col])
  args = [plan.tile_info, ls_rows, vs_rows, q_rows, _heads_major(k), _heads_major(v), do_rows, lse_rows]
  args += [] if moe else [d_rows]
  shape = (c, hkv, t, dh)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(hkv, plan.num_tiles),
      in_specs=in_specs + [any_spec, any_spec],
      out_specs=[head_rows, pl.BlockSpec((None, bp, 1), rows), pl.BlockSpec((None, bp, 1), rows),
                 kv_block, kv_block],
  )
  dq, dls, dvs, dk, dv = pl.pallas_call(
      functools.partial(_bwd_kernel, scale=dh ** -0.5, moe=moe),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((h, r, dh), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32)],
      input_output_aliases={len(args): 3, len(args) + 1: 4},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="routed_chapter_attention_bwd",
  )(*args, jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
  return dq, dls.sum((0, 2)), dvs.sum((0, 2)), _heads_major(dk), _heads_major(dv)
