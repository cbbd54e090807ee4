"""Product keys (Lample et al. 2019, "Large Memory Layers with Product Keys"): N = n^2 slots addressed by two
sets of n sub-keys, and the exact top-k over their sums.

A query splits into two halves; the first scores the n row sub-keys, the second the n column sub-keys, and slot
i*n + j scores row i's score plus column j's. The k best of the n^2 sums lie among the k best rows times the k
best columns (`product_top_k`), so a lookup costs O(n*d + k^2) per query instead of O(n^2*d), which is what lets
a table grow to millions of slots at a fixed cost per token. The same search picks the product router's chapters
(`routing.grid_route`), whose grid may end in a partial row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moc_jax.model.layers import normalize_tokens, param_init
from moc_jax.sharding import current, logical_spec

# The name of the search's result (the slot ids) in the forward pass: the remat policies (model/transformer.py) keep
# it, so the backward pass recomputes the chosen slots' scores but not the search that chose them.
SEARCH_RESULT = "product_key_ids"


def product_candidates(a: int, b: int, cells: int, k: int) -> tuple[int, int, int, int, int]:
  """How `product_top_k` searches the first `cells` cells of an a x b grid for its k best: (full rows, rows it
  takes from them, columns it takes, cells of a partial last row (0: the last row is full), cells it takes from
  that row). The FLOPs estimator (moc_jax/flops.py) counts the same search from these numbers."""
  last = cells - (a - 1) * b
  full, partial = (a, 0) if last == b else (a - 1, last)
  return full, min(k, full), min(k, b), partial, min(k, partial)


def product_top_k(rows, cols, k, cells=None):
  """The k best cells of the grid rows[..., i] + cols[..., j], cell i*b + j (the first `cells` cells, default all)
  -> (cell ids [..., k] int32 by descending value, ties to the lower id, as `lax.top_k` over every cell orders
  them; their values [..., k], differentiable in rows and cols).

  Exact, ties included: were k full rows ahead of a cell's row (greater, or equal and lower), the k cells they make
  with its column would all come before it; likewise k columns ahead of its column. So the k best full rows times
  the k best columns, plus the k best cells of a partial last row, hold the answer, and only those are ranked.
  (The argument needs a + c > a' + c wherever a > a'; in float32 two such sums can round to one value, and a cell
  whose row lost to k greater rows may then tie its way into a full top-k that this search does not see.)"""
  a, b = rows.shape[-1], cols.shape[-1]
  full, kr, kc, partial, kp = product_candidates(a, b, a * b if cells is None else cells, k)
  vals, ids = [], []
  if full:
    row_v, row_i = jax.lax.top_k(rows[..., :full], kr)
    col_v, col_i = jax.lax.top_k(cols, kc)
    vals.append((row_v[..., :, None] + col_v[..., None, :]).reshape(row_v.shape[:-1] + (-1,)))
    ids.append((row_i[..., :, None] * b + col_i[..., None, :]).reshape(row_i.shape[:-1] + (-1,)))
  if partial:
    last_v, last_i = jax.lax.top_k(cols[..., :partial], kp)
    vals.append(rows[..., full:] + last_v)
    ids.append(full * b + last_i)
  vals, ids = jax.lax.stop_gradient(jnp.concatenate(vals, -1)), jnp.concatenate(ids, -1)
  _, top = jax.lax.sort((-vals, ids), dimension=vals.ndim - 1, num_keys=2)  # by value, then by id
  top = top[..., :k]
  return top, jnp.take_along_axis(rows, top // b, axis=-1) + jnp.take_along_axis(cols, top % b, axis=-1)


class ProductKeys(nnx.Module):
  """Per head, two sets of n sub-keys [heads, 2, n, dim/2], and the lookup of queries [..., heads, dim]: the top-k
  slots of each head by `product_top_k` and a softmax over their k scores.

  Sub-keys start as Memory+'s U(-1/sqrt(dim), 1/sqrt(dim)) in variance, N(0, 1/(3*dim)). `query_norm=layernorm`
  normalises each query half without parameters (float32) before it is scored; scores are float32 from
  compute-dtype matmuls."""

  def __init__(self, heads, sub_keys, dim, top_k, query_norm, eps, compute_dtype, rngs):
    self.top_k, self.query_norm, self.eps, self.dtype = top_k, query_norm, eps, jnp.dtype(compute_dtype)
    self.keys = nnx.Param(param_init((3 * dim) ** -0.5, None, None, None, None)(
        rngs.params(), (heads, 2, sub_keys, dim // 2)))

  def __call__(self, q):
    """q [B, ..., heads, dim] -> (slot ids [B, ..., heads, k] int32, weights [B, ..., heads, k] float32).

    On a mesh each device looks up its own rows (a shard_map over the `batch` axes): GSPMD does not partition
    `lax.top_k`, and would otherwise gather every device's scores to rank them."""
    axes, mesh = current("batch")
    if not axes:
      return self._lookup(q, self.keys[...])
    rows = logical_spec(mesh, "batch", *(None,) * (q.ndim - 1))
    return jax.shard_map(self._lookup, mesh=mesh, in_specs=(rows, jax.P()), out_specs=(rows, rows))(
        q, self.keys[...])

  def _lookup(self, q, keys):
    """The search scores every sub-key but is not differentiated: the k chosen slots' scores are computed again
    from their two gathered sub-keys, so the backward pass touches k sub-key rows per query and head, not n, and
    never the [queries, heads, 2, n] scores (docs/results/2026-11-27-pkm-sparse-search.md)."""
    halves = normalize_tokens(q.reshape(q.shape[:-1] + (2, q.shape[-1] // 2)), self.query_norm, self.eps)
    halves, keys = halves.astype(self.dtype), keys.astype(self.dtype)
    # each half's scores [heads, ..., n] from a product of its own, heads first as the product leaves them: slicing
    # them out of one [..., heads, 2, n] product, or moving the heads back, copies the step's largest arrays again
    # (at 4M slots, more time than the product itself on a CPU)
    front = jnp.moveaxis(halves, -3, 0)  # [heads, ..., 2, dim/2]
    rows, cols = (jax.lax.stop_gradient(jnp.einsum("h...d,hnd->h...n", front[..., c, :], keys[:, c],
                                                   preferred_element_type=jnp.float32)) for c in (0, 1))
    ids = checkpoint_name(jnp.moveaxis(product_top_k(rows, cols, self.top_k)[0], 0, -2), SEARCH_RESULT)
    n, heads = keys.shape[2], jnp.arange(keys.shape[0])[:, None]
    top = sum(jnp.einsum("...hd,...hkd->...hk", halves[..., c, :], keys[heads, c, part],
                         preferred_element_type=jnp.float32) for c, part in enumerate((ids // n, ids % n)))
    return ids, jax.nn.softmax(top, axis=-1)
