"""Routed chapter attention in plain XLA: what CPUs and shapes the kernels do not support run.

The (token, slot) pairs are sorted by chapter and cut into tiles of `block_pairs` rows with the Pallas
kernels' plan (`dispatch.make_plan`): a tile reads exactly one chapter, so K/V are gathered once per tile,
not once per pair, and its scores are one small matmul per kv head, [block_pairs·G, dh] x [dh, T]. The
tiles run in chunks of `chunk_tiles` (a `lax.scan`), each chunk a few batched matmuls over rows
[tiles, Hkv, block_pairs·G, dh] and tiles [tiles, Hkv, T, dh]. A chunk's float32 buffers stay near
`CHUNK_BYTES` (512 KiB): they fit a CPU core's cache, and they are bounded at any shape.

Forward: "moe" runs each row's (pair's) softmax over its chapter's T tokens and scatter-adds
value_scale · softmax · V into a float32 [B·L, H, dh] accumulator, one pass. "joint" needs the token's
log-sum-exp over all its slots first: a first pass stacks each row's log-sum-exp ([rows, H]), the merge
LSE = logsumexp_s lse_s gathers them per token, and a second pass scatter-adds
value_scale · exp(z − LSE) · V. Both are exact; no buffer of [rows, H, dh] or larger is stacked.

Backward (custom VJP, flash style): it keeps the inputs and the plan, plus the output and the token LSE
(joint) or each row's log-sum-exp (moe), and recomputes the probabilities. dq, dK and dV are scatter-added
chunk by chunk into float32 accumulators ([B·L, H, dh] and [C, T, Hkv, dh]); only the per-row
d logit_scale and d value_scale ([rows] each) are stacked. The blocks are [T, rows] here, so that
dK = dzᵀq and dV = pᵀdout are plain matmuls; dq needs dz itself, one transposed copy per chunk.

Matmuls and statistics run in float32, operands converted after the gathers (on CPUs without bfloat16
matmul units that is also the fast path). The joint merge over slots is written as one gather per slot,
which XLA fuses into a single loop; reducing a gathered [N, S, ...] array over its slot axis is far slower
on CPU.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.routed_chapter_attention import dispatch
from kernels_pallas.routed_chapter_attention.contract import NEG_INF, check_combine

DEFAULT_BLOCK_PAIRS = 32  # rows (pairs of one chapter) per tile
CHUNK_BYTES = 1 << 19  # a chunk's float32 [tiles, H, block_pairs, max(T, dh)] row buffer stays <= this


def default_chunk_tiles(heads, block_pairs, t, dh):
  """Tiles per chunk: the most whose float32 [tiles, H, block_pairs, max(T, dh)] fits CHUNK_BYTES, >= 1."""
  return max(1, CHUNK_BYTES // (4 * heads * block_pairs * max(t, dh)))


def chunk_tiles_for(tiles, heads, block_pairs, t, dh, requested=None):
  """Tiles per chunk of a call whose plan has `tiles` (static) tiles: `requested` or the default, and never
  more than the call has (a decode step's few tiles would otherwise run a whole chunk of padding)."""
  return min(int(requested or default_chunk_tiles(heads, block_pairs, t, dh)), tiles)


class _Config(NamedTuple):
  combine: str
  block_pairs: int
  chunk_tiles: int


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, *, block_pairs=None,
                             chunk_tiles=None, return_lse=False):
  """See `contract`. Returns float32 [B, L, H, dh].

  return_lse (joint only): also return the float32 [B, L, H] log-sum-exp of the joint logits (NEG_INF for a
  token whose slots are all empty), differentiable, for callers that merge partial results across devices.
  block_pairs: rows per tile (DEFAULT_BLOCK_PAIRS); chunk_tiles: tiles per chunk (`chunk_tiles_for`).
  Ids outside [-1, C) read nothing, like -1 (`dispatch.valid_slots`).
  """
  check_combine(combine, return_lse)
  for name, value in (("block_pairs", block_pairs), ("chunk_tiles", chunk_tiles)):
    if value is not None and value < 1:
      raise ValueError(f"{name} must be positive, got {value}")
  _, t, _, dh = k.shape
  bp = int(block_pairs or DEFAULT_BLOCK_PAIRS)
  tiles = dispatch.num_tiles_bound(q.shape[0] * q.shape[1] * ids.shape[-1], k.shape[0], bp)
  cfg = _Config(combine, bp, chunk_tiles_for(tiles, q.shape[2], bp, t, dh, chunk_tiles))
  out, lse = _attention(q, k, v, ids, logit_scale, value_scale, cfg)
  return (out, lse) if return_lse else out


class _Rows(NamedTuple):
  """The plan per chunk. Tiles are padded to a multiple of chunk_tiles; padding rows (the plan's and these)
  name token N and have both scales 0, padding tiles read chapter 0, so they contribute exact zeros."""
  token: jax.Array        # [chunks, chunk_tiles·bp] int32
  chapter: jax.Array      # [chunks, chunk_tiles] int32
  logit_scale: jax.Array  # [chunks, chunk_tiles·bp] float32, logit_scale / sqrt(dh)
  value_scale: jax.Array  # [chunks, chunk_tiles·bp] float32


def _chunked_rows(plan, ids, logit_scale, value_scale, dh, cfg):
  n, s = ids.shape[0] * ids.shape[1], ids.shape[-1]
  tiles = plan.tile_info.shape[0]
  chunks = -(-tiles // cfg.chunk_tiles)
  pad = chunks * cfg.chunk_tiles - tiles

  def per_row(x, fill=0):
    return jnp.pad(x, (0, pad * cfg.block_pairs), constant_values=fill).reshape(chunks, -1)

  def scale(x, factor=1.0):
    return per_row(dispatch.pairs_to_rows(x.reshape(-1).astype(jnp.float32) * factor, plan))

  rows = _Rows(per_row(plan.row_pair // s, fill=n), jnp.pad(plan.tile_info >> 1, (0, pad)).reshape(chunks, -1),
               scale(logit_scale, 1 / jnp.sqrt(jnp.float32(dh))), scale(value_scale))
  # Materialised once: fused into the row gathers, the index arithmetic would rerun for every element.
  return _Rows(*lax.optimization_barrier(tuple(rows)))


def _tile_major(x, tiles, bp):
  """[tiles·bp, Hkv, G, d] rows -> [tiles, Hkv, bp·G, d] (G innermost)."""
  _, hkv, g, d = x.shape
  return x.reshape(tiles, bp, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(tiles, hkv, bp * g, d)


def _gather_rows(x, token, tiles, bp):
  """Per-token x [N, Hkv, G, d] -> float32 rows [tiles, Hkv, bp·G, d]. A padding row (token N) reads token
  N - 1; its scales are 0."""
  return _tile_major(jnp.take(x, token, axis=0, mode="clip").astype(jnp.float32), tiles, bp)


def _gather_tiles(x, chapter):
  """x [C, T, Hkv, d] -> float32 [tiles, Hkv, T, d]."""
  return jnp.take(x, chapter, axis=0).astype(jnp.float32).transpose(0, 2, 1, 3)


def _row_scalar(x, tiles, g):
  """[tiles·bp] per row -> [tiles, 1, bp·G, 1]."""
  bp = x.shape[0] // tiles
  return jnp.broadcast_to(x.reshape(tiles, 1, bp, 1), (tiles, 1, bp, g)).reshape(tiles, 1, bp * g, 1)


def _mm(spec, a, b):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)


def _stacked_rows(x, g):
  """Stacked chunk outputs [chunks, chunk_tiles, Hkv, bp·G] -> [rows, Hkv, G] in plan row order."""
  chunks, tiles, hkv, bpg = x.shape
  return jnp.swapaxes(x.reshape(chunks * tiles, hkv, bpg // g, g), 1, 2).reshape(-1, hkv, g)


def _slot_row(x, plan, n, s, j):
  """Per-row x [rows, ...] -> slot j's row of every token [N, ...]. An empty slot reads some row: mask it."""
  return jnp.take(x, plan.pair_row.reshape(n, s)[:, j], axis=0, mode="clip")


def _rows_to_tokens(acc, x, token, bp, g):
  """acc [N, Hkv, G, dh] += x [tiles, Hkv, bp·G, dh] scatter-added by row token (padding rows dropped)."""
  tiles, hkv, _, dh = x.shape
  x = x.reshape(tiles, hkv, bp, g, dh).transpose(0, 2, 1, 3, 4).reshape(tiles * bp, hkv, g, dh)
  return acc.at[token].add(x, mode="drop")


def _token_stat_rows(x, plan, rows_shape, bp):
  """Per-token x [N, Hkv, G, k] -> per row [chunks, chunk_tiles, Hkv, bp·G, k] (0 for padding rows)."""
  n, hkv, g, width = x.shape
  s = plan.pair_row.shape[0] // n
  chunks, tiles = rows_shape
  x = jnp.broadcast_to(x[:, None], (n, s, hkv, g, width)).reshape(n * s, hkv, g, width)
  x = dispatch.pairs_to_rows(x, plan)
  x = jnp.pad(x, ((0, chunks * tiles * bp - x.shape[0]), (0, 0), (0, 0), (0, 0)))
  return _tile_major(x, chunks * tiles, bp).reshape(chunks, tiles, hkv, bp * g, width)


def _forward(q, k, v, ids, logit_scale, value_scale, cfg):
  """Returns out, the joint LSE (None for moe), the plan, the chunked rows and, for moe, each row's
  log-sum-exp [chunks, chunk_tiles, Hkv, bp·G] (None for joint)."""
  b, l, h, dh = q.shape
  c, _, hkv, _ = k.shape
  n, s, g = b * l, ids.shape[-1], h // hkv
  bp, tc = cfg.block_pairs, cfg.chunk_tiles
  plan = dispatch.make_plan(ids.reshape(n, s).astype(jnp.int32), c, bp)
  rows = _chunked_rows(plan, ids, logit_scale, value_scale, dh, cfg)
  qg = q.reshape(n, hkv, g, dh)

  def scores(token, chapter, scale):  # [tiles, Hkv, bp·G, T]
    qs = _gather_rows(qg, token, tc, bp) * _row_scalar(scale, tc, g)
    return _mm("xhrd,xhtd->xhrt", qs, _gather_tiles(k, chapter))

  def row_lse(z):
    m = z.max(-1, keepdims=True)
    return m, jnp.exp(z - m).sum(-1, keepdims=True)

  lse = shift = None
  if cfg.combine == "joint":  # pass 1: each row's log-sum-exp, merged into the token's
    m, lsum = lax.map(lambda xs: row_lse(scores(*xs)), (rows.token, rows.chapter, rows.logit_scale))
    lse_rows = _stacked_rows((m + jnp.log(lsum))[..., 0], g)
    valid = dispatch.valid_slots(ids.reshape(n, s), c)[:, :, None, None]
    lse_slot = [jnp.where(valid[:, j], _slot_row(lse_rows, plan, n, s, j), NEG_INF) for j in range(s)]
    top = functools.reduce(jnp.maximum, lse_slot)
    lse = top + jnp.log(sum(jnp.exp(x - top) for x in lse_slot))  # [N, Hkv, G]
    shift = _token_stat_rows(lse[..., None], plan, rows.chapter.shape, bp)
    lse = lse.reshape(b, l, h)

  def chunk(acc, xs):
    token, chapter, scale, vscale, *joint_shift = xs
    z = scores(token, chapter, scale)
    if joint_shift:  # probabilities of the token's joint softmax
      e, weight, lse_row = jnp.exp(z - joint_shift[0]), _row_scalar(vscale, tc, g), None
    else:  # the row's own softmax
      m, lsum = row_lse(z)
      e = jnp.exp(z - m)
      weight, lse_row = _row_scalar(vscale, tc, g) / lsum, (m + jnp.log(lsum))[..., 0]
    o = _mm("xhrt,xhtd->xhrd", e, _gather_tiles(v, chapter)) * weight
    return _rows_to_tokens(acc, o, token, bp, g), lse_row

  xs = (*rows,) if shift is None else (*rows, shift)
  out, lse_rows = lax.scan(chunk, jnp.zeros(qg.shape, jnp.float32), xs)
  return out.reshape(b, l, h, dh), lse, plan, rows, lse_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, ids, logit_scale, value_scale, cfg):
  return _forward(q, k, v, ids, logit_scale, value_scale, cfg)[:2]


def _attention_fwd(q, k, v, ids, logit_scale, value_scale, cfg):
  out, lse, plan, rows, lse_rows = _forward(q, k, v, ids, logit_scale, value_scale, cfg)
  saved = (out, lse) if cfg.combine == "joint" else (None, lse_rows)  # joint: D = dout·out and the token LSE
  return (out, lse), (q, k, v, ids, logit_scale, value_scale, plan, rows, *saved)


def _attention_bwd(cfg, res, cts):
  """Row r of a tile of chapter c, its T probabilities p_rt (normalised over the row for moe, over all the
  token's slots for joint), a = logit_scale/sqrt(dh), vs = value_scale, qk_rt = q·k_t:
    dp_rt = dout·v_t;   dz_rt = p_rt (vs dp_rt − D),  D = dout·out − d_lse (joint) or vs Σ_t p_rt dp_rt (moe);
    dq += a Σ_t dz_rt k_t;   dK_c += a dz_r qᵀ;   dV_c += vs p_r doutᵀ;
    d logit_scale = Σ_t dz_rt qk_rt / sqrt(dh);   d value_scale = Σ_t p_rt dp_rt  (summed over heads).
  """
  q, k, v, ids, logit_scale, value_scale, plan, rows, out, lse = res
  dout, dlse = cts
  b, l, h, dh = q.shape
  c, t, hkv, _ = k.shape
  n, s, g = b * l, ids.shape[-1], h // hkv
  bp, tc = cfg.block_pairs, cfg.chunk_tiles
  qg, dog = q.reshape(n, hkv, g, dh), dout.reshape(n, hkv, g, dh)
  if cfg.combine == "joint":  # each row's token LSE and D, [chunks, chunk_tiles, Hkv, bp·G, 2]
    d = jnp.sum(dout.astype(jnp.float32) * out, -1) - dlse.astype(jnp.float32)
    stats = _token_stat_rows(jnp.stack([lse, d], -1).reshape(n, hkv, g, 2), plan, rows.chapter.shape, bp)
  else:  # each row's own log-sum-exp
    stats = lse[..., None]

  def chunk(carry, xs):
    dq, dk, dv = carry
    token, chapter, scale, vscale, stat = xs
    a, vs = (jnp.swapaxes(_row_scalar(x, tc, g), 2, 3) for x in (scale, vscale))  # [tiles, 1, 1, bp·G]
    stat = jnp.swapaxes(stat, 2, 3)  # [tiles, Hkv, 1 or 2, bp·G]
    qr, do = _gather_rows(qg, token, tc, bp), _gather_rows(dog, token, tc, bp)
    kx, vx = _gather_tiles(k, chapter), _gather_tiles(v, chapter)
    qk = _mm("xhtd,xhrd->xhtr", kx, qr)  # [tiles, Hkv, T, bp·G]
    p = jnp.exp(a * qk - stat[..., 0:1, :])
    dp = _mm("xhtd,xhrd->xhtr", vx, do)
    pdp = jnp.sum(p * dp, 2, keepdims=True)
    dz = p * (vs * dp - stat[..., 1:2, :]) if cfg.combine == "joint" else vs * p * (dp - pdp)
    dza = dz * a
    dk_x = _mm("xhtr,xhrd->xhtd", dza, qr)
    dv_x = _mm("xhtr,xhrd->xhtd", vs * p, do)
    # dq needs dz as [rows, T]. The barrier keeps this transposed copy: XLA would otherwise fold the
    # transpose into the matmul, whose transposed-operand form is several times slower on CPU.
    dq_x = _mm("xhrt,xhtd->xhrd", lax.optimization_barrier(jnp.swapaxes(dza, 2, 3)), kx)
    dq_x = dq_x.reshape(tc, hkv, bp, g, dh).transpose(0, 2, 1, 3, 4).reshape(tc * bp, hkv, g, dh)
    dq = dq.at[token].add(dq_x, mode="drop")  # padding rows (token N) are dropped
    dk = dk.at[chapter].add(dk_x.transpose(0, 2, 1, 3))
    dv = dv.at[chapter].add(dv_x.transpose(0, 2, 1, 3))
    per_row = lambda x: jnp.sum(x.reshape(tc, bp, g), -1).reshape(-1)  # noqa: E731  [tiles, bp·G] -> [tiles·bp]
    return (dq, dk, dv), (per_row(jnp.sum(dz * qk, (1, 2))), per_row(jnp.sum(pdp, (1, 2))))

  zeros_kv = jnp.zeros((c, t, hkv, dh), jnp.float32)
  (dq, dk, dv), (dls, dvs) = lax.scan(chunk, (jnp.zeros(qg.shape, jnp.float32), zeros_kv, zeros_kv),
                                      (*rows, stats))
  valid = dispatch.valid_slots(ids.reshape(n, s), c)

  def to_pairs(x, dtype):
    x = jnp.take(x.reshape(-1), plan.pair_row, mode="clip").reshape(n, s)
    return jnp.where(valid, x, 0.0).reshape(ids.shape).astype(dtype)

  return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          to_pairs(dls / jnp.sqrt(jnp.float32(dh)), logit_scale.dtype), to_pairs(dvs, value_scale.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)
