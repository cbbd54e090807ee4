"""Routed chapter attention as Pallas kernels over chapter-sorted tiles, with a custom VJP.

(token, slot) pairs are sorted by chapter and tiled (`dispatch`), so each chapter's K/V block is
fetched once per run of consecutive tiles and serves every token routed to it; no K/V is gathered per
pair. Per-pair partial outputs are merged per token in XLA. Backends: "tpu" (Mosaic, scalar-prefetched
tile metadata; `pallas_tpu`) and "gpu" (Triton-style pallas_call; `pallas_gpu`). On CPU the TPU kernels
run in interpret mode.

Ids must lie in [-1, C). That is checked here when ids are concrete; under jit it cannot be, and an
out-of-range id is the caller's error: `dispatch` then treats it as an empty slot, so no kernel ever
indexes K/V out of bounds (interpret=True would clamp such a read silently, hardware would read garbage).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.routed_chapter_attention import contract, dispatch, pallas_gpu, pallas_tpu

BACKENDS = {"tpu": pallas_tpu, "gpu": pallas_gpu}
DEFAULT_BLOCK_PAIRS = {"tpu": 128, "gpu": 64}  # TPU: MXU rows; GPU: one Triton program's query rows


class _Config(NamedTuple):
  combine: str
  backend: str
  block_pairs: int
  interpret: Any
  return_lse: bool


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, *, interpret=None,
                             backend=None, block_pairs=None, return_lse=False):
  """See `contract`. Returns float32 [B, L, H, dh], and with return_lse=True (joint only)
  also the float32 joint log-sum-exp [B, L, H] (-1e30 for a token without slots) for merging partial
  results across devices; it is differentiable.

  interpret: None = interpret on CPU only; True = the generic interpreter (either backend); a
    pltpu.InterpretParams = the TPU simulator (tpu backend; out-of-bounds and race checks).
  backend: "tpu" | "gpu" | None (the target platform's, `contract.target_platform`). block_pairs: rows per tile
    (backend default).
  """
  contract.check_arguments(q, k, v, ids, logit_scale, value_scale, combine, return_lse)
  platform = contract.target_platform()
  backend = backend or ("gpu" if platform == "gpu" else "tpu")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
  if interpret is None:
    interpret = platform == "cpu"
  block_pairs = block_pairs or DEFAULT_BLOCK_PAIRS[backend]
  BACKENDS[backend].check_blocks(q, k, block_pairs)
  if not isinstance(ids, jax.core.Tracer):
    ids_np = np.asarray(ids)
    if ids_np.size and (ids_np.min() < -1 or ids_np.max() >= k.shape[0]):
      raise ValueError(f"ids must lie in [-1, {k.shape[0]}); got [{ids_np.min()}, {ids_np.max()}]")
  cfg = _Config(combine, backend, block_pairs, interpret, return_lse)
  return _call(q, k, v, ids, logit_scale, value_scale, cfg)


@functools.partial(jax.jit, static_argnums=6)
def _call(q, k, v, ids, logit_scale, value_scale, cfg):
  return _attention(q, k, v, ids, logit_scale, value_scale, cfg)


def _rows(q, ids, scale, plan):
  """Queries [H, R, dh] and a per-pair scale [R, 1] (float32) in the plan's row order."""
  b, l, h, dh = q.shape
  q_rows = dispatch.tokens_to_rows(q.reshape(b * l, h, dh).transpose(1, 0, 2), plan, ids.shape[-1])
  return q_rows, dispatch.pairs_to_rows(scale.reshape(-1).astype(jnp.float32), plan)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, ids, logit_scale, value_scale, cfg):
  return _attention_fwd(q, k, v, ids, logit_scale, value_scale, cfg)[0]


def _attention_fwd(q, k, v, ids, logit_scale, value_scale, cfg):
  b, l, h, dh = q.shape
  n, s = b * l, ids.shape[-1]
  plan = dispatch.make_plan(ids.reshape(n, s), k.shape[0], cfg.block_pairs)
  q_rows, ls_rows = _rows(q, ids, logit_scale, plan)
  o_rows, lse_rows = BACKENDS[cfg.backend].forward(plan, q_rows, k, v, ls_rows, block_pairs=cfg.block_pairs,
                                                   interpret=cfg.interpret)
  out, lse = dispatch.merge(o_rows, lse_rows[..., 0], plan, dispatch.valid_slots(ids.reshape(n, s), k.shape[0]),
                            value_scale.reshape(n, s), cfg.combine)
  result = out.transpose(1, 0, 2).reshape(b, l, h, dh)
  if cfg.return_lse:
    result = (result, lse.T.reshape(b, l, h))
  # joint keeps the token's out and LSE (D = dout.out); moe keeps each row's own lse.
  saved = (out, lse) if cfg.combine == "joint" else (None, lse_rows)
  return result, (q, k, v, ids, logit_scale, value_scale, plan, *saved)


def _attention_bwd(cfg, residuals, cotangent):
  q, k, v, ids, logit_scale, value_scale, plan, out, lse = residuals
  b, l, h, dh = q.shape
  n, s = b * l, ids.shape[-1]
  dout, dlse = cotangent if cfg.return_lse else (cotangent, None)
  dout = dout.reshape(n, h, dh).transpose(1, 0, 2).astype(jnp.float32)
  d_rows = None
  if cfg.combine == "joint":
    d = jnp.sum(dout * out, -1)
    if dlse is not None:
      d = d - dlse.reshape(n, h).T
    d_rows = dispatch.tokens_to_rows(d, plan, s)[..., None]
    lse = dispatch.tokens_to_rows(lse, plan, s)[..., None]
  q_rows, ls_rows = _rows(q, ids, logit_scale, plan)
  vs_rows = dispatch.pairs_to_rows(value_scale.reshape(-1).astype(jnp.float32), plan)[:, None]
  do_rows = dispatch.tokens_to_rows(dout.astype(q.dtype), plan, s)
  dq_rows, dls_rows, dvs_rows, dk, dv = BACKENDS[cfg.backend].backward(
      plan, q_rows, k, v, ls_rows, vs_rows, do_rows, lse, d_rows, block_pairs=cfg.block_pairs,
      interpret=cfg.interpret)
  dq = dispatch.rows_to_pairs(dq_rows, plan, axis=1).reshape(h, n, s, dh).sum(2)
  dq = dq.transpose(1, 0, 2).reshape(q.shape)
  dls = dispatch.rows_to_pairs(dls_rows, plan).reshape(ids.shape)
  dvs = dispatch.rows_to_pairs(dvs_rows, plan).reshape(ids.shape)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          dls.astype(logit_scale.dtype), dvs.astype(value_scale.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)
