"""Product keys (moc_jax.model.product_keys) against brute force over every slot, written in float64 numpy.

* `product_top_k` must return what a top-k over all a*b cells returns, ties included (lower cell first, as
  `lax.top_k` orders them): on square grids, on grids whose last row is partial (the product router's), with k
  past a side, and with integer-valued scores that tie everywhere (their sums are exact in float32).
* `ProductKeys` (scores of each query half against its sub-keys, the search, the softmax over the k) must equal a
  numpy lookup that scores all n^2 slots, with and without the query norm.
* `product_candidates` is the search the FLOPs estimator counts.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moc_jax.model.product_keys import ProductKeys, product_candidates, product_top_k


def brute_top_k(rows, cols, k, cells):
  """float64: every cell's value, then the k best by (value descending, cell ascending)."""
  grid = (rows[..., :, None].astype(np.float64) + cols[..., None, :]).reshape(rows.shape[:-1] + (-1,))[..., :cells]
  order = np.lexsort((np.broadcast_to(np.arange(cells), grid.shape), -grid), axis=-1)[..., :k]
  return order, np.take_along_axis(grid, order, axis=-1)


top_k = jax.jit(product_top_k, static_argnums=(2, 3))


@pytest.mark.parametrize("a, b, cells, k", [
    (8, 8, 64, 4),    # a square grid (product keys)
    (8, 8, 64, 8),    # k = a side
    (5, 4, 18, 3),    # a partial last row of 2 cells (the product router's grid)
    (5, 4, 17, 6),    # a last row of 1 cell, k past a side
    (3, 3, 9, 9),     # every cell
    (1, 6, 6, 2),     # one row
    (6, 1, 6, 4),     # one column
])
@pytest.mark.parametrize("ties", [False, True])
def test_product_top_k_equals_a_brute_force_top_k_over_every_cell(a, b, cells, k, ties):
  rng = np.random.default_rng(a * 100 + b * 10 + k)
  shape = (7, 3)  # leading query axes
  if ties:  # small integers: many equal rows, columns and sums, every sum exact in float32
    rows, cols = (rng.integers(-2, 3, shape + (n,)).astype(np.float32) for n in (a, b))
  else:
    rows, cols = (rng.normal(size=shape + (n,)).astype(np.float32) for n in (a, b))
  ids, vals = top_k(jnp.asarray(rows), jnp.asarray(cols), k, cells)
  want_ids, want_vals = brute_top_k(rows, cols, k, cells)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(vals), want_vals, rtol=1e-6, atol=1e-6)


def test_all_equal_scores_give_the_first_k_cells():
  ids, _ = top_k(jnp.zeros((2, 4)), jnp.zeros((2, 4)), 5, None)
  np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3, 4]] * 2)


def test_product_top_k_values_carry_the_gradient_of_the_cells_chosen():
  """d(sum of the chosen values)/d rows[i] = how many chosen cells lie in row i (columns likewise)."""
  rng = np.random.default_rng(0)
  rows, cols = (jnp.asarray(rng.normal(size=(6,)).astype(np.float32)) for _ in range(2))
  g_rows, g_cols = jax.grad(lambda r, c: jnp.sum(product_top_k(r, c, 4)[1]), argnums=(0, 1))(rows, cols)
  ids, _ = brute_top_k(np.asarray(rows), np.asarray(cols), 4, 36)
  np.testing.assert_array_equal(np.asarray(g_rows), np.bincount(ids // 6, minlength=6))
  np.testing.assert_array_equal(np.asarray(g_cols), np.bincount(ids % 6, minlength=6))


@pytest.mark.parametrize("a, b, cells, k, want", [
    (64, 64, 4096, 8, (64, 8, 8, 0, 0)),
    (9, 8, 65, 8, (8, 8, 8, 1, 1)),
    (2, 1, 2, 8, (2, 2, 1, 0, 0)),
    (3, 4, 10, 3, (2, 2, 3, 2, 2)),
])
def test_product_candidates(a, b, cells, k, want):
  assert product_candidates(a, b, cells, k) == want


# --- ProductKeys against numpy --------------------------------------------------------------------

def np_layernorm(x, eps):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def np_lookup(q, keys, k, norm, eps):
  """float64: q [..., H, dim], keys [H, 2, n, dim/2] -> ids, weights [..., H, k] over all n^2 slots."""
  halves = q.reshape(q.shape[:-1] + (2, -1)).astype(np.float64)
  if norm == "layernorm":
    halves = np_layernorm(halves, eps)
  scores = np.einsum("...hcd,hcnd->...hcn", halves, keys.astype(np.float64))
  n = keys.shape[2]
  grid = (scores[..., 0, :, None] + scores[..., 1, None, :]).reshape(scores.shape[:-2] + (n * n,))
  ids = np.argsort(-grid, axis=-1, kind="stable")[..., :k]
  top = np.take_along_axis(grid, ids, -1)
  w = np.exp(top - top.max(-1, keepdims=True))
  return ids, w / w.sum(-1, keepdims=True)


@pytest.mark.parametrize("norm", ["none", "layernorm"])
def test_lookup_equals_numpy_over_every_slot(norm):
  heads, n, dim, k = 3, 16, 8, 5
  keys = ProductKeys(heads, n, dim, k, norm, 1e-5, "float32", nnx.Rngs(params=0))
  q = np.random.default_rng(1).normal(size=(2, 11, heads, dim)).astype(np.float32)
  ids, weights = jax.jit(lambda m, q: m(q))(keys, jnp.asarray(q))
  want_ids, want_w = np_lookup(q, np.asarray(keys.keys[...]), k, norm, 1e-5)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5, atol=1e-6)
  assert keys.keys[...].shape == (heads, 2, n, dim // 2)


def test_lookup_gradient_equals_numpy_through_the_chosen_sub_keys():
  """d(sum(weights * c)) / d(q, keys) in float64 numpy: only the chosen slots' two sub-keys per query and head carry
  a gradient (the search itself is not differentiated, its choice is)."""
  heads, n, dim, k = 3, 16, 8, 5
  keys = ProductKeys(heads, n, dim, k, "none", 1e-5, "float32", nnx.Rngs(params=0))
  rng = np.random.default_rng(2)
  q = rng.normal(size=(2, 7, heads, dim)).astype(np.float32)
  c = rng.normal(size=(2, 7, heads, k))
  table = np.asarray(keys.keys[...], np.float64)

  def loss(table, q):  # the lookup with the sub-key table as an argument (on no mesh, keys(q) is this)
    return jnp.sum(keys._lookup(q, table)[1] * c)

  g_table, g_q = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(table, jnp.float32), jnp.asarray(q))
  ids, w = np_lookup(q, table, k, "none", 1e-5)
  d_top = w * (c - np.sum(w * c, -1, keepdims=True))  # softmax backward, [2, 7, heads, k]
  halves = q.reshape(q.shape[:-1] + (2, -1)).astype(np.float64)
  want_table, want_q = np.zeros_like(table), np.zeros_like(halves)
  for idx in np.ndindex(*ids.shape[:-1]):
    h = idx[-1]
    for j, slot in enumerate(ids[idx]):
      for part, sub in enumerate((slot // n, slot % n)):
        want_table[h, part, sub] += d_top[idx][j] * halves[idx][part]
        want_q[idx][part] += d_top[idx][j] * table[h, part, sub]
  np.testing.assert_allclose(np.asarray(g_table), want_table, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g_q), want_q.reshape(q.shape), rtol=1e-4, atol=1e-6)
