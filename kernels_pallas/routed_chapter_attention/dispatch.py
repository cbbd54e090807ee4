"""Sorting, tiling and merging (plain XLA, static shapes, jit-friendly) and the per-block math, shared by
the TPU and GPU kernels.

The N = B*L tokens times S slots give P = N*S (token, slot) pairs, pair p = n*S + s. Non-empty pairs
are sorted by chapter (stable) and each chapter's group is padded up to a multiple of the tile size
`block_pairs` (megablox-style group metadata), so a tile of `block_pairs` rows reads exactly one chapter
and consecutive tiles of a chapter reuse its K/V. Kernels see "rows" (the padded sorted order, R rows);
per-pair partial results are merged per token here, exactly: o_pair is normalised within the pair and
lse_pair is its log-sum-exp, so joint attention is sum_s exp(lse_s - LSE) vs_s o_s.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.routed_chapter_attention.contract import NEG_INF


def num_tiles_bound(num_pairs: int, num_chapters: int, block_pairs: int) -> int:
  """Static upper bound on tiles: sum_c ceil(n_c / bp) <= (P + K (bp - 1)) / bp, K = chapters in use."""
  used = min(num_chapters, num_pairs)
  return max(1, min(num_pairs, (num_pairs + used * (block_pairs - 1)) // block_pairs))


class Plan(NamedTuple):
  """Tile metadata (all int32). R = tiles * block_pairs rows; sentinels are P (rows) and R (pairs)."""
  tile_info: jax.Array    # [tiles] chapter << 1 | (tile is its chapter's first); tiles past num_tiles
                          #   (never run) repeat the last run tile's chapter, unflagged
  num_tiles: jax.Array    # [] tiles in use (at least 1: an all-empty batch runs one all-padding tile)
  row_pair: jax.Array     # [R] pair of each row, P for a padding row
  pair_row: jax.Array     # [P] row of each pair, R for an empty slot
  run_chapter: jax.Array  # [U] chapters in use, ascending, U = min(C, P); C for unused entries
  run_start: jax.Array    # [U] first tile of each run of one chapter's tiles
  run_stop: jax.Array     # [U] one past its last tile


def valid_slots(ids: jax.Array, num_chapters: int) -> jax.Array:
  """Slots that read a chapter. Ids outside [0, C) are empty: an out-of-range id (the caller's error)
  is dropped rather than read out of bounds."""
  return (ids >= 0) & (ids < num_chapters)


def make_plan(ids: jax.Array, num_chapters: int, block_pairs: int) -> Plan:
  """ids [N, S] int32, -1 = empty slot."""
  n, s = ids.shape
  p, c, bp = n * s, num_chapters, block_pairs
  tiles = num_tiles_bound(p, c, bp)
  rows = tiles * bp
  key = jnp.where(valid_slots(ids, c), ids, c).reshape(p).astype(jnp.int32)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  sorted_key = key[order]
  counts = jnp.zeros(c + 1, jnp.int32).at[key].add(1)[:c]
  tiles_per = (counts + bp - 1) // bp
  tile_stop = jnp.cumsum(tiles_per, dtype=jnp.int32)
  tile_start = tile_stop - tiles_per
  pair_start = jnp.cumsum(counts, dtype=jnp.int32) - counts
  valid = sorted_key < c
  safe = jnp.minimum(sorted_key, c - 1)
  row_sorted = tile_start[safe] * bp + jnp.arange(p, dtype=jnp.int32) - pair_start[safe]
  row_sorted = jnp.where(valid, row_sorted, rows)
  row_pair = jnp.full(rows, p, jnp.int32).at[row_sorted].set(order, mode="drop")
  pair_row = jnp.full(p, rows, jnp.int32).at[order].set(row_sorted)

  used = tile_stop[-1]
  t = jnp.arange(tiles, dtype=jnp.int32)
  # A tile's first row is always a real pair (padding only ends a chapter's last tile).
  first_pair = row_pair[jnp.minimum(t, jnp.maximum(used - 1, 0)) * bp]
  chapter = jnp.where(first_pair < p, key[jnp.minimum(first_pair, p - 1)], 0)
  first = (t == 0) | ((t < used) & (chapter != jnp.roll(chapter, 1)))
  run_chapter = jnp.nonzero(counts > 0, size=min(c, p), fill_value=c)[0].astype(jnp.int32)
  return Plan(
      tile_info=chapter << 1 | first.astype(jnp.int32),
      num_tiles=jnp.maximum(used, 1),
      row_pair=row_pair,
      pair_row=pair_row,
      run_chapter=run_chapter,
      run_start=jnp.take(tile_start, run_chapter, mode="fill", fill_value=0),
      run_stop=jnp.take(tile_stop, run_chapter, mode="fill", fill_value=0),
  )


def tokens_to_rows(x: jax.Array, plan: Plan, num_slots: int) -> jax.Array:
  """x [H, N, ...] per token -> [H, R, ...] per row (padding rows get 0)."""
  return jnp.take(x, plan.row_pair // num_slots, axis=1, mode="fill", fill_value=0)


def pairs_to_rows(x: jax.Array, plan: Plan) -> jax.Array:
  """x [P, ...] per pair -> [R, ...] per row (padding rows get 0)."""
  return jnp.take(x, plan.row_pair, axis=0, mode="fill", fill_value=0)


def rows_to_pairs(x: jax.Array, plan: Plan, axis: int = 0) -> jax.Array:
  """x [..., R, ...] per row -> [..., P, ...] per pair (empty slots get 0)."""
  return jnp.take(x, plan.pair_row, axis=axis, mode="fill", fill_value=0)


def merge(o_rows, lse_rows, plan, valid, value_scale, combine):
  """Per-row partials (o_rows [H, R, dh], lse_rows [H, R]) -> (out [H, N, dh], LSE [H, N] or None).

  valid, value_scale: [N, S]. joint: out = sum_s exp(lse_s - LSE) vs_s o_s, LSE = logsumexp_s lse_s
  (NEG_INF for a token without slots); moe: out = sum_s vs_s o_s.
  """
  h, _, dh = o_rows.shape
  n, s = valid.shape
  o = rows_to_pairs(o_rows, plan, axis=1).reshape(h, n, s, dh)
  weight = jnp.broadcast_to(jnp.where(valid, value_scale.astype(jnp.float32), 0.0), (h, n, s))
  lse = None
  if combine == "joint":
    lse_pair = jnp.where(valid, rows_to_pairs(lse_rows, plan, axis=1).reshape(h, n, s), NEG_INF)
    m = lse_pair.max(-1)
    lse = m + jnp.log(jnp.exp(lse_pair - m[..., None]).sum(-1))
    weight = weight * jnp.exp(lse_pair - lse[..., None])
  out = jnp.einsum("hns,hnsd->hnd", weight, o, precision=jax.lax.Precision.HIGHEST)
  return out, lse


# Per-block math used inside both backends' kernels (pure jnp on tiles already loaded from refs).
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def precision(dtype):
  """float32 operands ask for full float32 matmuls, never a backend's reduced-precision default."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def matmul(a, b, dims=(((1,), (0,)), ((), ()))):
  """a @ b (or with `dims`) on operands cast to b's dtype, accumulated in float32."""
  return jax.lax.dot_general(a.astype(b.dtype), b, dims, precision=precision(b.dtype),
                             preferred_element_type=jnp.float32)


def attend(q, k, v, a):
  """q [bp, dh]; k, v [T, dh]; a [bp, 1] = logit_scale / sqrt(dh) -> (o [bp, dh] normalised, lse [bp, 1])."""
  z = matmul(q, k, NT) * a
  m = z.max(-1, keepdims=True)
  p = jnp.exp(z - m)
  l = p.sum(-1, keepdims=True)
  return matmul(p, v) / l, m + jnp.log(l)


def probs_and_dz(q, k, v, do, a, c, lse_ref, d):
  """Recomputes a block's probabilities and logit gradients: (qk, p, dov, dz), each [bp, T] float32.

  p = exp(z - lse_ref); dov = dout . v_t; dz = p (c dov - D). d=None means moe: D = c dout . o_pair,
  with o_pair = p @ v recomputed rather than stored by the forward pass.
  """
  qk = matmul(q, k, NT)
  p = jnp.exp(qk * a - lse_ref)
  dov = matmul(do, v, NT)
  if d is None:
    d = c * jnp.sum(do.astype(jnp.float32) * matmul(p, v), -1, keepdims=True)
  return qk, p, dov, p * (c * dov - d)
