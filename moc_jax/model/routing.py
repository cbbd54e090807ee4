"""Routing decisions: what each decision sees (a row's mean, a position, a prefix, a chunk; in training and in
cached decoding), the router, top-k selection, chapter weights and the router's auxiliary losses.

MoC-PT's rules (docs/mocpt_semantics.md): softmax over all chapters, top-k over the routed ones, weights
renormalised over the selected set, shared chapters first with raw weight 1 and routed ones with
`routed_scaling_factor * w`, all divided by their sum.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moc_jax.config import cluster_ranges, router_factors
from moc_jax.config.schema import CAUSAL_ROUTINGS, GENERIC_PATH
from moc_jax.model.layers import dense, rms_normalize
from moc_jax.model.product_keys import product_top_k


def resolve_decode_routing(mem):
  """`memory.decode_routing` with `auto` resolved: the training routing when it is causal (cached
  decoding then equals a full forward), `sequence` (routed once on the prompt) otherwise."""
  if mem.decode_routing != "auto":
    return mem.decode_routing
  return mem.routing if mem.routing in CAUSAL_ROUTINGS else "sequence"


def route(logits, num_shared, top_k, bias=None):
  """MoC-PT routing on router logits [..., C] (float32), one decision per leading index.

  Returns (probs [...,C] over all chapters, routed ids [...,k] in chapter space sorted by descending
  probability, routed weights [...,k] = softmax restricted to the selected set).
  MoC-PT renormalises probabilities twice (drop shared, keep top-k); that equals top-k on the routed
  logits and a softmax over the selected ones, which we compute directly: it stays finite when the
  shared chapter takes all the probability mass (the load-balance loss's degenerate minimum), where
  the renormalisation divides 0 by 0.

  `bias` [C] (aux-free balancing) shifts the top-k *choice* only: the weights of the chosen chapters are
  still the softmax of their unbiased logits, and no gradient reaches the bias.
  """
  logits = logits.astype(jnp.float32)
  routed = logits[..., num_shared:]
  if bias is None:
    top_logits, top_idx = jax.lax.top_k(routed, top_k)
  else:
    _, top_idx = jax.lax.top_k(routed + jax.lax.stop_gradient(bias[num_shared:]), top_k)
    top_logits = jnp.take_along_axis(routed, top_idx, axis=-1)
  return jax.nn.softmax(logits, axis=-1), top_idx + num_shared, jax.nn.softmax(top_logits, axis=-1)


def mix_weights(routed_weights, num_shared, scaling):
  """Chapter weights for [shared..., routed...]: raw [1,...,f*w...] divided by their sum (MoC-PT's mixing)."""
  ones = jnp.ones(routed_weights.shape[:-1] + (num_shared,), routed_weights.dtype)
  raw = jnp.concatenate([ones, scaling * routed_weights], axis=-1)
  return raw / jnp.sum(raw, axis=-1, keepdims=True)


def with_shared(routed_ids, num_shared):
  """Chapter list [shared 0..s-1, routed...] for every decision."""
  shared = jnp.arange(num_shared, dtype=routed_ids.dtype)
  return jnp.concatenate([jnp.broadcast_to(shared, routed_ids.shape[:-1] + (num_shared,)), routed_ids], -1)


def cluster_chapters(paths, num_shared, k, per_level, generic=False):
  """`memory.routing=cluster`: the chapters each position reads, from its document's path down the cluster tree.

  paths [..., levels] (the node's index within each level, `data.cluster`; -1 on padding, read as node 0;
  GENERIC_PATH for a document on the generic chapters) -> chapter ids [..., s + Σ r_l]: the shared chapters, then for
  each level l the r_l = per_level[l] chapters of the path's node there (`config.cluster_ranges` lays them out), or
  with `generic` (data.cluster.generic > 0) the Σ r_l generic chapters where the path is GENERIC_PATH."""
  ranges, generic_start = cluster_ranges(num_shared, k, per_level, generic)
  ids = []
  for level, (r, (start, _)) in enumerate(zip(per_level, ranges)):
    node = jnp.maximum(paths[..., level], 0).astype(jnp.int32)
    ids.append(start + node[..., None] * r + jnp.arange(r, dtype=jnp.int32))
  ids = jnp.concatenate(ids, axis=-1)
  if generic:
    ids = jnp.where(paths[..., :1] == GENERIC_PATH, generic_start + jnp.arange(sum(per_level), dtype=jnp.int32), ids)
  return with_shared(ids, num_shared)


def cluster_tree(cfg) -> tuple:
  """The tree a path-fetched read lays its chapters on: (data.cluster.k, memory.cluster_chapters,
  memory.num_chapters, whether generic chapters follow the tree's)."""
  return (cfg.data.cluster.k, tuple(cfg.memory.cluster_chapters), cfg.memory.num_chapters,
          bool(cfg.data.cluster.generic))


def cluster_reads(paths, num_shared, tree, valid=None):
  """A path-fetched read's chapters (`cluster_chapters` on `cluster_tree`'s tree) and `load` [C]: the reads of each
  path-owned chapter over the real positions (`valid` [B, L]), the router health a router's choice would report."""
  k, per_level, num_chapters, generic = tree
  chapters = cluster_chapters(paths, num_shared, k, per_level, generic)
  routed = chapters[..., num_shared:]
  real = jnp.ones(routed.shape[:-1]) if valid is None else valid.astype(jnp.float32)
  load = jnp.zeros((num_chapters,), jnp.float32).at[routed].add(jnp.broadcast_to(real[..., None], routed.shape))
  return chapters, load


def subtree_mask(paths, num_shared, k, per_level, num_chapters):
  """`memory.routing=subtree`: the chapters each position's router may choose, bool [..., C] (paths [..., levels],
  -1 on padding read as node 0): the shared ones and those owned by its document's level-0 node and every node below
  it, laid out as `cluster_chapters` lays them out (node j of level l lies below level-0 node j // k**l)."""
  ranges, _ = cluster_ranges(num_shared, k, per_level, False)
  top = np.full(num_chapters, -1, np.int32)
  for level, (r, (start, stop)) in enumerate(zip(per_level, ranges)):
    if r:
      top[start:stop] = np.arange(stop - start) // r // k ** level
  node = jnp.maximum(paths[..., 0], 0).astype(jnp.int32)
  return (jnp.asarray(top) == node[..., None]) | (jnp.arange(num_chapters) < num_shared)


def router_losses(logits, probs, routed_ids, num_shared, load_balance):
  """Per-layer router statistics: the losses (load balance by `memory.load_balance`, z-loss, MSE aux,
  entropy; MoC-PT's) and the router's health.

  Every routing decision (a row, a position or a chunk) is one sample. `mocpt`: MoC-PT's C·Σ f_i·P_i with
  f = routed selections per decision (shared chapters have f = 0) and P the mean softmax over all chapters,
  shared included — minimised by moving all probability onto the shared chapters. `routed` and `aux_free`:
  R·Σ f_i·P_i over the R routable chapters, f the share of routed selections (sums to 1) and P the mean
  softmax of the routable logits alone; 1 when both are uniform (Switch Transformer's loss).

  Health (not losses): `load` [C] routed selections per chapter, `shared_mass` the mean probability on the
  shared chapters, `routed_entropy` the mean entropy of the routable softmax (nats).
  """
  c = probs.shape[-1]
  logits, probs, routed_ids = (x.reshape(-1, x.shape[-1]) for x in (logits, probs, routed_ids))
  # selections per chapter, counted without a [decisions, k, C] one-hot
  load = jnp.zeros((c,), jnp.float32).at[routed_ids.reshape(-1)].add(1.0)
  routed_probs = jax.nn.softmax(logits[:, num_shared:].astype(jnp.float32), axis=-1)
  if load_balance == "mocpt":
    balance = c * jnp.sum(load / routed_ids.shape[0] * jnp.mean(probs, axis=0))
  else:
    share = load[num_shared:] / jnp.maximum(jnp.sum(load[num_shared:]), 1.0)
    balance = (c - num_shared) * jnp.sum(share * jnp.mean(routed_probs, axis=0))
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return {
      "load_balance": balance,
      "z_loss": jnp.mean(jnp.square(lse)),
      "mse_aux": jnp.mean(jnp.square(jnp.mean(jnp.square(probs), axis=0) - 1.0 / c)),
      "entropy": _mean_entropy(probs),
      "load": load,
      "shared_mass": jnp.mean(jnp.sum(probs[:, :num_shared], axis=-1)),
      "routed_entropy": _mean_entropy(routed_probs),
  }


class GridLogits(NamedTuple):
  """The product router's logits, never expanded: routable chapter s + i*b + j (0 <= i*b + j < routable) has logit
  rows[..., i] + cols[..., j]; shared chapter c < s has shared[..., c]. Everything the train step needs from all C
  logits — the exact top-k, the normalisers and every router statistic — follows from the factors in
  O(a + b) per decision (`grid_route`, `grid_router_losses`), so the step does not grow with the bank."""
  shared: jax.Array  # [..., s] float32 (s may be 0)
  rows: jax.Array    # [..., a] float32
  cols: jax.Array    # [..., b] float32
  routable: int

  def dense(self):
    """The logits [..., C] of every chapter (what `Router.__call__` returns)."""
    grid = (self.rows[..., :, None] + self.cols[..., None, :]).reshape(self.rows.shape[:-1] + (-1,))
    return jnp.concatenate([self.shared, grid[..., :self.routable]], axis=-1)

  @property
  def last_row(self) -> int:
    """Cells of the grid's last row that hold a chapter (the other rows are full)."""
    return self.routable - (self.rows.shape[-1] - 1) * self.cols.shape[-1]


def grid_route(g: GridLogits, top_k, bias=None):
  """`route` on grid logits -> (routed ids [..., k] in chapter space, routed weights [..., k]), bit for bit what
  `route(g.dense(), ...)` returns, from O(k^2) candidates (`product_keys.product_top_k`: the top-k rows times the
  top-k columns, plus a partial last row's top-k cells). Ties go to the lower chapter, as in `lax.top_k`. With the
  aux-free bias (one value per chapter, no factors) the choice needs the expanded logits."""
  s = g.shared.shape[-1]
  if bias is not None:
    _, ids, weights = route(g.dense(), s, top_k, bias)
    return ids, weights
  top_idx, top_logits = product_top_k(g.rows, g.cols, top_k, g.routable)
  return top_idx + s, jax.nn.softmax(top_logits, axis=-1)


def _grid_moments(g: GridLogits):
  """Per decision: the routable log-normaliser, the mean logit under the routable softmax, and the factors of
  that softmax's cells, q[i, j] = row_w[i] * col_w[j] for the matmuls of `_grid_mean`. Both factors are shifted
  by the row maximum (outside the gradient: the shift cancels in every product), so row_w <= 1 and col_w
  stays near q's scale instead of overflowing with large logits."""
  a, last = g.rows.shape[-1], g.last_row
  full_r = g.rows[..., :a - 1]
  lse_c, lse_c_last = jax.nn.logsumexp(g.cols, axis=-1), jax.nn.logsumexp(g.cols[..., :last], axis=-1)
  row_mass = jnp.concatenate([full_r + lse_c[..., None], g.rows[..., a - 1:] + lse_c_last[..., None]], -1)
  lse = jax.nn.logsumexp(row_mass, axis=-1)
  lse_full_r = jax.nn.logsumexp(full_r, axis=-1)  # -inf with one row
  in_last = jnp.arange(g.cols.shape[-1]) < last
  col_rows = jnp.where(in_last, jnp.logaddexp(lse_full_r, g.rows[..., a - 1])[..., None], lse_full_r[..., None])
  mean_logit = (jnp.sum(jnp.exp(row_mass - lse[..., None]) * g.rows, -1)
                + jnp.sum(jnp.exp(g.cols + col_rows - lse[..., None]) * g.cols, -1))
  top = jax.lax.stop_gradient(jnp.max(g.rows, axis=-1, keepdims=True))
  return lse, mean_logit, jnp.exp(g.rows - top), jnp.exp(g.cols + top - lse[..., None])


def _grid_mean(row_w, col_w, scale, routable):
  """mean over decisions of scale * row_w[i] * col_w[j] at every routable chapter -> [routable] (one matmul)."""
  n = row_w.shape[0]
  cells = jnp.matmul(row_w.T, col_w * scale[:, None], precision=jax.lax.Precision.HIGHEST) / n
  return cells.reshape(-1)[:routable]


def grid_router_losses(g: GridLogits, routed_ids, num_shared, load_balance):
  """`router_losses` of grid logits, to float32 rounding, in O(decisions x (s + a + b)) plus two
  [a, decisions] x [decisions, b] matmuls for the per-chapter means (MoC-PT's balance P, the MSE aux):
  log-normalisers from row and column log-sum-exps, entropies as log-normaliser minus mean logit."""
  s = num_shared
  n = math.prod(g.rows.shape[:-1])
  shared, rows, cols = (x.reshape(n, x.shape[-1]) for x in (g.shared, g.rows, g.cols))
  g = GridLogits(shared, rows, cols, g.routable)
  routed_ids = routed_ids.reshape(-1, routed_ids.shape[-1])
  c = s + g.routable
  lse_r, mean_r, row_w, col_w = _grid_moments(g)
  lse = jnp.logaddexp(lse_r, jax.nn.logsumexp(shared, axis=-1)) if s else lse_r
  shared_p = jnp.exp(shared - lse[:, None])
  routed_mass = jnp.exp(lse_r - lse)
  load = jnp.zeros((c,), jnp.float32).at[routed_ids.reshape(-1)].add(1.0)
  if load_balance == "mocpt":
    mean_p = _grid_mean(row_w, col_w, routed_mass, g.routable)  # shared chapters have no load
    balance = c * jnp.sum(load[s:] / routed_ids.shape[0] * mean_p)
  else:
    share = load[s:] / jnp.maximum(jnp.sum(load[s:]), 1.0)
    balance = g.routable * jnp.sum(share * _grid_mean(row_w, col_w, jnp.ones_like(lse), g.routable))
  mean_sq = jnp.concatenate([jnp.mean(jnp.square(shared_p), axis=0),
                             _grid_mean(jnp.square(row_w), jnp.square(col_w), jnp.square(routed_mass), g.routable)])
  entropy = lse - jnp.sum(shared_p * shared, axis=-1) - routed_mass * mean_r
  return {
      "load_balance": balance,
      "z_loss": jnp.mean(jnp.square(lse)),
      "mse_aux": jnp.mean(jnp.square(mean_sq - 1.0 / c)),
      "entropy": jnp.mean(entropy),
      "load": load,
      "shared_mass": jnp.mean(jnp.sum(shared_p, axis=-1)),
      "routed_entropy": jnp.mean(lse_r - mean_r),
  }


def read_weight(chapters, weights, num_chapters, valid=None):
  """How much each chapter was read: per memory layer, the chapter weights of every decision summed per chapter.
  chapters / weights [n_mem, ..., s+k] (aux `chapters` / `weights`; weights None: each chapter read whole, weight 1,
  as FFN memory reads its path's columns), optional `valid` masking the decisions (broadcast against
  chapters[1:-1]) -> [n_mem, num_chapters] float32, outside the gradient."""
  w = jnp.ones(chapters.shape, jnp.float32) if weights is None else jax.lax.stop_gradient(weights).astype(jnp.float32)
  if valid is not None:
    w = w * valid[..., None].astype(jnp.float32)
  flat = lambda x: x.reshape(x.shape[0], -1)
  return jax.vmap(lambda c, v: jnp.zeros((num_chapters,), jnp.float32).at[c].add(v))(flat(chapters), flat(w))


def _mean_entropy(probs):
  return jnp.mean(-jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-12)), axis=-1))


def routing_input(h, valid, routing, chunk, segments=None, weights=None):
  """What each routing decision sees, from the layer input h [B, L, d], the non-pad mask valid [B, L] and,
  for packed rows, segment_ids [B, L] (a document is a contiguous run of one id):
  sequence [B, d] (plain mean of the row, pads included, as MoC-PT); token [B, L, d] (h itself);
  segment [B, L, d] (masked mean of the position's document; of the row without segment ids); prefix
  [B, L, d] (masked mean of its document's positions <= t); chunk (masked mean of its document's positions
  before the chunk; zeros when there are none, so the router sees its bias alone) per chunk
  [B, ceil(L/chunk), d], or per position [B, L, d] with segment ids (a document may start inside a chunk).
  No decision of segment, prefix or chunk routing sees another document's tokens.

  `weights` [B, L] (`memory.routing_pool=attention`, `pool_weights`) replaces the mask by each position's
  weight: every mean above, sequence's too, becomes the weighted mean of the same positions."""
  h = h.astype(jnp.float32)
  if routing == "token":
    return h
  if routing == "sequence":
    return jnp.mean(h, axis=1) if weights is None else masked_mean(h, weights)
  w = weights
  if w is None:
    w = jnp.ones(h.shape[:2], jnp.float32) if valid is None else valid.astype(jnp.float32)
  if segments is None:
    total, count = jnp.cumsum(h * w[..., None], axis=1), jnp.cumsum(w, axis=1)[..., None]
  else:
    total, count = document_cumsum(h * w[..., None], segments), document_cumsum(w[..., None], segments)
  if routing == "prefix":
    return _ratio(total, count)
  if segments is None:  # one document per row: sequence-wide means, chunk decisions per chunk
    if routing == "segment":
      return jnp.broadcast_to(_ratio(total[:, -1:], count[:, -1:]), h.shape)
    before = jnp.arange(0, h.shape[1], chunk) - 1  # sums up to the position before each chunk start
    total = jnp.where(before[None, :, None] >= 0, jnp.take(total, jnp.maximum(before, 0), axis=1), 0.0)
    count = jnp.where(before[None, :, None] >= 0, jnp.take(count, jnp.maximum(before, 0), axis=1), 0.0)
    return _ratio(total, count)
  first, last = document_bounds(segments)
  if routing == "chunk":  # the document's sums up to the position before the chunk start, if inside it
    last = jnp.arange(h.shape[1])[None, :] // chunk * chunk - 1
  inside = (last >= first)[..., None]
  pick = jnp.maximum(last, 0)[..., None]
  total = jnp.where(inside, jnp.take_along_axis(total, pick, axis=1), 0.0)
  count = jnp.where(inside, jnp.take_along_axis(count, pick, axis=1), 0.0)
  return _ratio(total, count)


def _ratio(total, count):
  """A weighted mean from its sums: total / count, zeros where nothing was pooled (count 0). With 0/1 weights
  this is total / max(count, 1), bit for bit."""
  return total / jnp.where(count > 0, count, 1.0)


POOL_SCORE_CAP = 10.0  # |score| bound of attention pooling: weights within e^±10, so running sums stay in float32


def pool_weights(h, valid, query, eps):
  """Attention pooling's weight of each position in its routing decision's mean: valid · exp(s) with
  s = cap · tanh(query · rms_normalize(h) / cap) [B, L] float32.

  A position's weight depends on its own input alone, so every causal routing stays causal and the running
  sums of `routing_input` and `cached_routing_input` need no running maximum: the cap keeps exp(s) in
  [e^-10, e^10]. A zero query (its initial value) weighs every position alike: the plain masked mean."""
  s = jnp.einsum("bld,d->bl", rms_normalize(h, eps), query.astype(jnp.float32))
  w = jnp.exp(POOL_SCORE_CAP * jnp.tanh(s / POOL_SCORE_CAP))
  return w if valid is None else w * valid.astype(jnp.float32)


def pool_share(weights):
  """How far attention pooling has left the plain mean, per decision row: exp(entropy) of the row's normalised
  weights over its positions of non-zero weight, averaged over rows (1: every position alike; 1/n: one of n
  positions decides). A row's documents are taken together: a health figure, not a routing input."""
  n = jnp.sum(weights > 0, axis=1)
  p = weights / jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1e-30)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-30)), 0.0), axis=1)
  return jnp.mean(jnp.exp(entropy) / jnp.maximum(n, 1))


def document_starts(segments):
  """[B, L] bool: the positions where a document (a contiguous run of equal segment ids) begins."""
  return jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)


def document_bounds(segments):
  """(first, last) position [B, L] of each position's document."""
  b, length = segments.shape
  t = jnp.broadcast_to(jnp.arange(length), (b, length))
  starts = document_starts(segments)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones((b, 1), bool)], axis=1)  # the next position starts one
  return (jax.lax.cummax(jnp.where(starts, t, 0), axis=1),
          jax.lax.cummin(jnp.where(ends, t, length - 1), axis=1, reverse=True))


def document_cumsum(x, segments):
  """Running sums of x [B, L, ...] along the row that restart at every document start: no sum carries a value
  across a document boundary, not even as rounding."""
  starts = document_starts(segments)
  starts = starts.reshape(starts.shape + (1,) * (x.ndim - 2))

  def combine(a, b):
    return jnp.where(b[1], b[0], a[0] + b[0]), a[1] | b[1]

  return jax.lax.associative_scan(combine, (x, jnp.broadcast_to(starts, x.shape)), axis=1)[0]


def per_position(x, routing, chunk, length):
  """Decisions [B, D, ...] -> [B, length, ...]: chunk decisions repeat over their chunk's positions
  (decisions already made per position, as in cached decoding, pass through)."""
  if routing == "chunk" and x.shape[1] != length:
    return jnp.repeat(x, chunk, axis=1)[:, :length]
  return x


def masked_mean(x, valid):
  """Mean over axis 1 of x [B, L, d] at the positions valid [B, L] marks, or weighted by float weights [B, L]
  (zeros where none)."""
  w = valid.astype(jnp.float32)[..., None]
  return _ratio(jnp.sum(x.astype(jnp.float32) * w, axis=1), jnp.sum(w, axis=1))


def cached_routing_input(state, h, valid, routing, chunk, index):
  """`routing_input` of the positions at slots index, index+1, ... of a row whose earlier layer inputs
  `state` summarises ({} before the first call) -> (new state, per-position routing inputs [B, L, d]).
  prefix keeps the running masked sum and count of the inputs; chunk also keeps them as of the
  current chunk's start; token keeps nothing. `valid` may be attention-pooling weights (`pool_weights`)."""
  h = h.astype(jnp.float32)
  if routing == "token":
    return {}, h
  b, l, d = h.shape
  w = valid.astype(jnp.float32)
  total0, count0 = state.get("total", jnp.zeros((b, d))), state.get("count", jnp.zeros((b,)))
  # running sums over the slots before index + j, j = 0..L
  total = jnp.concatenate([total0[:, None], total0[:, None] + jnp.cumsum(h * w[..., None], axis=1)], axis=1)
  count = jnp.concatenate([count0[:, None], count0[:, None] + jnp.cumsum(w, axis=1)], axis=1)
  new = {"total": total[:, -1], "count": count[:, -1]}
  if routing == "prefix":
    return new, _ratio(total[:, 1:], count[:, 1:, None])
  # chunk: the sums before each slot's chunk start; a chunk that began before this call uses the saved ones
  start = (index + jnp.arange(l + 1)) // chunk * chunk - index
  inside = start >= 0
  total = jnp.where(inside[None, :, None], jnp.take(total, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_total", jnp.zeros((b, d)))[:, None])
  count = jnp.where(inside[None, :], jnp.take(count, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_count", jnp.zeros((b,)))[:, None])
  new.update(chunk_total=total[:, -1], chunk_count=count[:, -1])
  return new, _ratio(total[:, :-1], count[:, :-1, None])


def cached_decision_input(state, h, valid, routing, window):
  """One routing decision per cached-decoding call for the decode-only strategies -> (new state, pooled
  [B, d]). sequence: the masked mean of the call's (the prompt's) inputs, no state (the memory layer keeps
  the chapters it chose instead); rolling: the masked mean of the last `window` layer inputs, this call's
  included, kept in the state; hybrid: the first call (the prompt) routes on its own masked mean and seeds
  the window, later calls as rolling (MoC-PT's). `valid` may be attention-pooling weights (`pool_weights`)."""
  if routing == "sequence":
    return state, masked_mean(h, valid)
  b, _, d = h.shape
  recent = jnp.concatenate([state.get("window", jnp.zeros((b, window, d))), h.astype(jnp.float32)], axis=1)[:, -window:]
  seen = jnp.concatenate([state.get("seen", jnp.zeros((b, window), valid.dtype)), valid], axis=1)[:, -window:]
  first_hybrid = routing == "hybrid" and not state
  pooled = masked_mean(h, valid) if first_hybrid else masked_mean(recent, seen)
  return {"window": recent, "seen": seen}, pooled


class BalanceBias(nnx.Param):
  """Aux-free balancing's per-chapter bias on the top-k choice: saved, sharded and restored with the
  parameters, but outside the optimizer (its own group, never updated by gradients or weight decay); the
  train step moves it after each update (`balance_bias_step`)."""


def balance_bias_step(load, num_shared, rate):
  """The bias change [..., C] from one update's routed selections per chapter `load` [..., C]:
  rate * sign(mean load - load) over the routable chapters (underused chapters rise), 0 on shared ones."""
  routable = load[..., num_shared:]
  step = rate * jnp.sign(jnp.mean(routable, axis=-1, keepdims=True) - routable)
  return jnp.concatenate([jnp.zeros_like(load[..., :num_shared]), step], axis=-1)


class Router(nnx.Module):
  """One router per memory layer: logits [..., C] over all chapters (`memory.router`), and the aux-free balance
  bias when `memory.load_balance=aux_free`.

  `linear` (MoC-PT's): one [d, C] matrix with bias. `product`: the R routable chapters on an a x b grid
  (`config.router_factors`); a chapter's logit is its row's logit plus its column's, from [d, a] and [d, b]
  matrices with biases (PKM's product keys), and the shared chapters' come from their own [d, s] matrix. The
  router then holds (s + a + b)·d weights instead of C·d, so its gradient and update stay near 2·sqrt(C)·d
  however large the bank grows; the logits of every chapter are still formed (an outer sum, no matmul), so the
  top-k is exact and every routing statistic is the linear router's. Each half starts at init_std / sqrt(2), so
  the summed logits start at the linear router's scale. The train step never expands them (`GridLogits`).

  `memory.routing_pool=attention` adds a learned query [d] (zeros at init: the plain mean) that weighs the positions
  a decision pools (`pool_weights`), so a decision can follow the few tokens that name what a document is about
  instead of the template words that dominate a mean.
  """

  def __init__(self, cfg, rngs):
    mem, d, dt = cfg.memory, cfg.model.d_model, jnp.dtype(cfg.model.compute_dtype)
    std = cfg.model.init_std
    self.routable = mem.num_chapters - mem.num_shared
    if mem.router == "linear":
      self.proj = dense(d, mem.num_chapters, std, ("embed", "chapter_logits"), dt, rngs, bias=True)
    else:
      a, b = router_factors(cfg)
      self.shared = (dense(d, mem.num_shared, std, ("embed", "chapter_logits"), dt, rngs, bias=True)
                     if mem.num_shared else None)
      self.rows = dense(d, a, std / math.sqrt(2), ("embed", "chapter_factors"), dt, rngs, bias=True)
      self.cols = dense(d, b, std / math.sqrt(2), ("embed", "chapter_factors"), dt, rngs, bias=True)
    self.pool_query = (nnx.Param(jnp.zeros((d,), jnp.float32), out_sharding=("embed",), eager_sharding=False)
                       if mem.routing_pool == "attention" else None)
    self.pool_eps = cfg.model.norm_eps
    self.balance_bias = (BalanceBias(jnp.zeros((mem.num_chapters,)), out_sharding=("chapter_logits",),
                                     eager_sharding=False)
                         if mem.load_balance == "aux_free" else None)

  def weigh(self, h, valid):
    """Each position's weight in its routing decision's mean under `memory.routing_pool=attention` (`pool_weights`,
    from the learned query), or None: the plain mean of `routing_input`."""
    if self.pool_query is None:
      return None
    return pool_weights(h, valid, self.pool_query[...], self.pool_eps)

  @property
  def factored(self) -> bool:
    return not hasattr(self, "proj")

  def __call__(self, pooled):
    """Logits [..., C] (float32) of routing inputs [..., d] (see `routing_input`)."""
    if not self.factored:
      return self.proj(pooled).astype(jnp.float32)
    return self.grid(pooled).dense()

  def grid(self, pooled):
    """The product router's logits as `GridLogits` (float32), unexpanded."""
    rows, cols = self.rows(pooled).astype(jnp.float32), self.cols(pooled).astype(jnp.float32)
    shared = (jnp.zeros(rows.shape[:-1] + (0,), jnp.float32) if self.shared is None
              else self.shared(pooled).astype(jnp.float32))
    return GridLogits(shared, rows, cols, self.routable)
