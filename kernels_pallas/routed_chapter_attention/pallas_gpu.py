"""GPU kernels over the chapter-sorted tiles of `dispatch`, as Triton-style pallas_calls.

Why Triton-style rather than Mosaic GPU: its lowering is registered in the CPU jaxlib, so the real
kernel lowering (Triton IR, power-of-2 shape checks) can be exercised here without a GPU, and the same
kernels run in the generic interpreter (interpret=True); the Mosaic GPU lowering needs the CUDA plugin.
Porting to `plgpu.kernel` is the way forward once the Triton backend is removed (deprecated in jax 0.11).

GPU has no scalar prefetch: the tile -> chapter table, K and V are whole-array operands and each
program reads its chapter id and loads k[chapter, :, kv_head, :] ([T, dh], the caller's layout).
  forward, dq:  grid (H, tiles); program (h, i) handles head h of tile i; unused tiles exit early.
  dK/dV:        grid (Hkv, U) over runs of one chapter's tiles; program (j, u) loops over the run's
                tiles and stores its chapter's [T, dh] block once (no atomics; dK/dV alias a zeros
                buffer so unvisited chapters read zero). A chapter with many tiles is one serial program.
Block rules: bp, T and dh powers of two and >= 16 (Triton dot tiles).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.routed_chapter_attention import dispatch
from kernels_pallas.routed_chapter_attention.dispatch import TN, matmul


def check_blocks(q, k, block_pairs):
  """Raises ValueError unless every array a kernel materialises has power-of-2 dims >= 16."""
  for name, d in (("block_pairs", block_pairs), ("T", k.shape[1]), ("head_dim", k.shape[-1])):
    if d < 16 or d & (d - 1):
      raise ValueError(f"GPU (Triton) kernels need {name}={d} to be a power of two >= 16")


def _whole(x):
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _params():
  return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _fwd_kernel(info_ref, used_ref, ls_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, group):
  h, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i < used_ref[0])
  def _():
    chapter = info_ref[i] >> 1
    o, lse = dispatch.attend(q_ref[...], k_ref[chapter, :, h // group, :], v_ref[chapter, :, h // group, :],
                             ls_ref[...] * scale)
    o_ref[...] = o
    lse_ref[...] = lse


def forward(plan, q_rows, k, v, ls_rows, *, block_pairs, interpret):
  """Per-row attention to the row's chapter: (o [H, R, dh] normalised per row, lse [H, R, 1])."""
  h, r, dh = q_rows.shape
  bp, tiles = block_pairs, plan.tile_info.shape[0]
  used = plan.num_tiles[None]
  rows = lambda hh, i: (hh, i, 0)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, scale=dh ** -0.5, group=h // k.shape[2]),
      grid=(h, tiles),
      in_specs=[_whole(plan.tile_info), _whole(used), pl.BlockSpec((bp, 1), lambda hh, i: (i, 0)),
                pl.BlockSpec((None, bp, dh), rows), _whole(k), _whole(v)],
      out_specs=[pl.BlockSpec((None, bp, dh), rows), pl.BlockSpec((None, bp, 1), rows)],
      out_shape=[jax.ShapeDtypeStruct((h, r, dh), jnp.float32), jax.ShapeDtypeStruct((h, r, 1), jnp.float32)],
      compiler_params=_params(),
      interpret=interpret,
      name="routed_chapter_attention_fwd",
  )(plan.tile_info, used, ls_rows, q_rows, k, v)


def _dq_kernel(info_ref, used_ref, ls_ref, vs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, *rest, scale, group):
  d_ref, (dq_ref, dls_ref, dvs_ref) = (rest[0] if len(rest) == 4 else None), rest[-3:]
  h, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i < used_ref[0])
  def _():
    chapter = info_ref[i] >> 1
    k = k_ref[chapter, :, h // group, :]
    a = ls_ref[...] * scale
    qk, p, dov, dz = dispatch.probs_and_dz(q_ref[...], k, v_ref[chapter, :, h // group, :], do_ref[...], a,
                                           vs_ref[...], lse_ref[...], None if d_ref is None else d_ref[...])
    dq_ref[...] = a * matmul(dz, k)
    dls_ref[...] = scale * jnp.sum(dz * qk, -1, keepdims=True)
    dvs_ref[...] = jnp.sum(p * dov, -1, keepdims=True)


def _dkv_kernel(chapter_ref, start_ref, stop_ref, ls_ref, vs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, *rest,
                scale, group, block_pairs, num_chapters):
  d_ref, (dk_ref, dv_ref) = (rest[0] if len(rest) == 5 else None), rest[-2:]
  j, u = pl.program_id(0), pl.program_id(1)
  chapter = chapter_ref[u]

  @pl.when(chapter < num_chapters)
  def _():
    k, v = k_ref[chapter, :, j, :], v_ref[chapter, :, j, :]

    def tile(i, acc):
      dk, dv = acc
      rows = pl.ds(pl.multiple_of(i * block_pairs, block_pairs), block_pairs)
      a, c = ls_ref[rows, :] * scale, vs_ref[rows, :]
      for g in range(group):
        h = j * group + g
        q, do = q_ref[h, rows, :], do_ref[h, rows, :]
        _, p, _, dz = dispatch.probs_and_dz(q, k, v, do, a, c, lse_ref[h, rows, :],
                                            None if d_ref is None else d_ref[h, rows, :])
        dk += matmul(dz * a, q, TN)
        dv += matmul(p.astype(do.dtype), (c * do).astype(do.dtype), TN)
      return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(start_ref[u], stop_ref[u], tile, (zeros, zeros))
    dk_ref[chapter, :, j, :] = dk
    dv_ref[chapter, :, j, :] = dv


def backward(plan, q_rows, k, v, ls_rows, vs_rows, do_rows, lse_rows, d_rows, *, block_pairs, interpret):
  """Returns dq_rows [H, R, dh], dls_rows [R], dvs_rows [R] and dk, dv [C, T, Hkv, dh] (float32).

  lse_rows: the token's joint LSE per row (joint) or the row's own lse (moe, then d_rows is None).
  """
  h, r, dh = q_rows.shape
  c, t, hkv, _ = k.shape
  bp, tiles, group = block_pairs, plan.tile_info.shape[0], h // hkv
  scale = dh ** -0.5
  used = plan.num_tiles[None]
  extra = [] if d_rows is None else [d_rows]
  rows = lambda hh, i: (hh, i, 0)
  col = pl.BlockSpec((bp, 1), lambda hh, i: (i, 0))
  head_col = pl.BlockSpec((None, bp, 1), rows)
  dq, dls, dvs = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, group=group),
      grid=(h, tiles),
      in_specs=[_whole(plan.tile_info), _whole(used), col, col, pl.BlockSpec((None, bp, dh), rows), _whole(k),
                _whole(v), pl.BlockSpec((None, bp, dh), rows), head_col] + [head_col] * len(extra),
      out_specs=[pl.BlockSpec((None, bp, dh), rows), head_col, head_col],
      out_shape=[jax.ShapeDtypeStruct((h, r, dh), jnp.float32), jax.ShapeDtypeStruct((h, r, 1), jnp.float32),
                 jax.ShapeDtypeStruct((h, r, 1), jnp.float32)],
      compiler_params=_params(),
      interpret=interpret,
      name="routed_chapter_attention_dq",
  )(plan.tile_info, used, ls_rows, vs_rows, q_rows, k, v, do_rows, lse_rows, *extra)

  args = [plan.run_chapter, plan.run_start, plan.run_stop, ls_rows, vs_rows, q_rows, k, v, do_rows, lse_rows,
          *extra]
  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, group=group, block_pairs=bp, num_chapters=c),
      grid=(hkv, plan.run_chapter.shape[0]),
      in_specs=[_whole(x) for x in args] + [_whole(zeros)] * 2,
      out_specs=[_whole(zeros)] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, jnp.float32)] * 2,
      input_output_aliases={len(args): 0, len(args) + 1: 1},
      compiler_params=_params(),
      interpret=interpret,
      name="routed_chapter_attention_dkv",
  )(*args, zeros, jnp.zeros(k.shape, jnp.float32))
  return dq, dls.sum((0, 2)), dvs.sum((0, 2)), dk, dv
