"""`memory.router=product` against float64 numpy restatements and hand counts: its logits and gradients, its
grid, the factored top-k and statistics the train step uses instead of the expanded logits, its parameter and
FLOPs counts, the config's refusal of an unknown router and the MoC-PT import's refusal of a router MoC-PT does
not have."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import flops
from moc_jax.config import router_factors
from moc_jax.convert.mocpt import param_map
from moc_jax.errors import ConfigError
from moc_jax.model.routing import GridLogits, Router, grid_route, grid_router_losses, route, router_losses

TINY = "configs/moc.py:tiny"


def _config(chapters, shared, router="product", overrides=None):
  return moc_jax.load_config(TINY, {"memory.num_chapters": chapters, "memory.num_tokens": chapters * 16,
                                    "memory.num_shared": shared, "memory.router": router,
                                    "memory.top_k": min(8, chapters - shared),
                                    "model.compute_dtype": "float32", **(overrides or {})})


@pytest.mark.parametrize("routable, want", [(64, (8, 8)), (65, (9, 8)), (2, (2, 1)), (131071, (363, 362))])
def test_grid_covers_every_routable_chapter_once(routable, want):
  """a = ceil(sqrt(R)), b = ceil(R / a): a*b >= R cells, fewer than a row of them empty."""
  a, b = router_factors(_config(routable + 1, 1))
  assert (a, b) == want
  assert a == math.ceil(math.sqrt(routable)) and a * b >= routable > a * (b - 1)


def _numpy_logits(router, x, shared):
  """Chapter c < s: the shared matrix's logit c; routable chapter r = c - s: row r // b's logit plus column
  r % b's, in float64."""
  def lin(m):
    return x @ np.asarray(m.kernel[...], np.float64) + np.asarray(m.bias[...], np.float64)
  rows, cols = lin(router.rows), lin(router.cols)
  b = cols.shape[-1]
  routable = [rows[:, r // b] + cols[:, r % b] for r in range(router.routable)]
  parts = ([lin(router.shared)] if shared else []) + [np.stack(routable, axis=-1)]
  return np.concatenate(parts, axis=-1)


@pytest.mark.parametrize("chapters, shared", [(66, 1), (65, 0), (67, 2)])
def test_logits_match_numpy(chapters, shared):
  cfg = _config(chapters, shared)
  router = Router(cfg, nnx.Rngs(3))
  for m in ([router.shared] if shared else []) + [router.rows, router.cols]:  # non-zero biases too
    m.bias.set_value(jax.random.normal(jax.random.key(7), m.bias.shape) * 0.1)
  x = np.random.default_rng(0).standard_normal((5, cfg.model.d_model)).astype(np.float32)
  got = np.asarray(router(jnp.asarray(x)))
  assert got.shape == (5, chapters) and got.dtype == np.float32
  np.testing.assert_allclose(got, _numpy_logits(router, x.astype(np.float64), shared), rtol=1e-5, atol=1e-6)


def test_gradients_match_numpy():
  """d sum(w * logits): the row matrix gets x^T (w summed over each row's chapters), the column matrix x^T (w summed
  over each column's chapters), the shared matrix x^T w_shared; the empty cells past the last chapter get none."""
  cfg = _config(66, 1)  # R = 65 on a 9 x 8 grid: 7 empty cells
  router = Router(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(1)
  x = rng.standard_normal((4, cfg.model.d_model)).astype(np.float32)
  w = rng.standard_normal((4, 66)).astype(np.float32)
  graphdef, params = nnx.split(router, nnx.Param)

  def loss(p):
    return jnp.sum(jnp.asarray(w) * nnx.merge(graphdef, p)(jnp.asarray(x)))
  g = jax.grad(loss)(params)
  a, b = router_factors(cfg)
  wg = np.zeros((4, a * b))
  wg[:, :65] = w[:, 1:]
  wg = wg.reshape(4, a, b).astype(np.float64)
  x64 = x.astype(np.float64)
  np.testing.assert_allclose(g["rows"]["kernel"][...], x64.T @ wg.sum(2), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g["cols"]["kernel"][...], x64.T @ wg.sum(1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g["rows"]["bias"][...], wg.sum((0, 2)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g["cols"]["bias"][...], wg.sum((0, 1)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g["shared"]["kernel"][...], x64.T @ w[:, :1], rtol=1e-5, atol=1e-5)


# --- the factored path: top-k and statistics without expanding the grid ------------------------------

GRIDS = [(65, 1, 8), (64, 0, 8), (7, 2, 3), (1, 1, 1), (2, 1, 2), (30, 1, 30), (131071, 1, 8)]  # (R, s, k)


def _grid(routable, shared, decisions, rng, ties=False):
  a = math.isqrt(routable - 1) + 1
  b = -(-routable // a)
  draw = ((lambda n: rng.integers(-2, 3, (decisions, n))) if ties else (lambda n: rng.standard_normal((decisions, n))))
  return GridLogits(*(jnp.asarray(draw(n), jnp.float32) for n in (shared, a, b)), routable)


@pytest.mark.parametrize("routable, shared, k", GRIDS)
@pytest.mark.parametrize("ties", [False, True])
def test_grid_top_k_is_the_expanded_top_k_bit_for_bit(routable, shared, k, ties):
  """Full rows, a short last row, one row, k = every chapter; integer logits tie often, and a tie goes to the lower
  chapter in both. With the aux-free bias the choice is made on the expanded logits."""
  rng = np.random.default_rng(routable + k)
  g = _grid(routable, shared, 5, rng, ties)
  _, want_ids, want_w = route(g.dense(), shared, k)
  ids, w = grid_route(g, k)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(w, want_w)
  bias = jnp.asarray(rng.standard_normal(shared + routable), jnp.float32)
  for got, want in zip(grid_route(g, k, bias), route(g.dense(), shared, k, bias)[1:]):
    np.testing.assert_array_equal(got, want)


def _numpy_stats(z, ids, s, load_balance):
  """MoC-PT's router statistics restated in float64 from the expanded logits z [N, C]."""
  def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  entropy = lambda p: np.mean(-np.sum(p * np.log(p), -1))
  n, c = z.shape
  p, q = softmax(z), softmax(z[:, s:])
  load = np.bincount(ids.reshape(-1), minlength=c).astype(np.float64)
  if load_balance == "mocpt":
    balance = c * np.sum(load / n * p.mean(0))
  else:
    balance = (c - s) * np.sum(load[s:] / load[s:].sum() * q.mean(0))
  lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
  return {"load_balance": balance, "z_loss": np.mean(lse ** 2), "mse_aux": np.mean(((p ** 2).mean(0) - 1 / c) ** 2),
          "entropy": entropy(p), "load": load, "shared_mass": p[:, :s].sum(-1).mean(), "routed_entropy": entropy(q)}


@pytest.mark.parametrize("routable, shared, k", GRIDS[:-1])
@pytest.mark.parametrize("load_balance", ["mocpt", "routed"])
def test_grid_statistics_match_numpy(routable, shared, k, load_balance):
  """Balance, z-loss, MSE aux, entropies and shared mass from row and column log-sum-exps and two matmuls equal the
  float64 statistics of the expanded logits."""
  rng = np.random.default_rng(routable)
  g = _grid(routable, shared, 6, rng)
  g = g._replace(rows=3 * g.rows)  # a confident router: probabilities far from uniform
  ids, _ = grid_route(g, k)
  got = grid_router_losses(g, ids, shared, load_balance)
  want = _numpy_stats(np.asarray(g.dense(), np.float64), np.asarray(ids), shared, load_balance)
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("routable, shared, k, load_balance", [
    (65, 1, 8, "mocpt"), (64, 0, 8, "routed"), (7, 2, 3, "mocpt"),
    pytest.param(1000, 1, 8, "routed", marks=pytest.mark.slow)])  # 65 already has cells past the last chapter
def test_grid_gradients_equal_the_expanded_paths(routable, shared, k, load_balance):
  """The router's gradient through the factored path (losses and routed weights) equals the gradient through
  `route` and `router_losses` on the expanded logits."""
  rng = np.random.default_rng(k)
  parts = tuple(_grid(routable, shared, 5, rng))[:3]
  v = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)

  def objective(parts, factored):
    g = GridLogits(*parts, routable)
    if factored:
      ids, w = grid_route(g, k)
      st = grid_router_losses(g, ids, shared, load_balance)
    else:
      z = g.dense()
      probs, ids, w = route(z, shared, k)
      st = router_losses(z, probs, ids, shared, load_balance)
    return st["load_balance"] + 3 * st["z_loss"] + 50 * st["mse_aux"] + jnp.sum(w * v)
  for got, want in zip(jax.grad(objective)(parts, True), jax.grad(objective)(parts, False)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want), initial=1.0)))


def test_parameter_count_by_hand():
  """Per memory layer the router holds (s + a + b)(d + 1) values instead of C(d + 1); nothing else changes."""
  linear, product = (moc_jax.count_params(_config(66, 1, r)) for r in ("linear", "product"))
  d, layers = 64, 2  # tiny: d_model 64, memory at layers 1 and 3
  assert product["memory_layers"] == linear["memory_layers"] - layers * (66 - (1 + 9 + 8)) * (d + 1)
  assert {k: v for k, v in product.items() if k not in ("memory_layers", "total")} == \
      {k: v for k, v in linear.items() if k not in ("memory_layers", "total")}


def test_flops_by_hand():
  """Sequence routing, B = 1, s = 1, R = 65 on a 9 x 8 grid (8 full rows, 1 chapter in the last), k = 8: the
  factored path the train step runs, counted by hand; the statistics never touch a C-sized softmax."""
  sequence = {"memory.routing": "sequence"}
  router = flops.estimate(_config(66, 1, overrides=sequence), 1, 128)["memory_layer"]["memory"]
  assert router["router"] == {
      "total": 8_192 + 2_304 + 244 + 65 + 48,
      "pool": 64 * 127 + 64, "linear": 2 * 64 * (1 + 9 + 8),
      "top_k": 8 * 3 + 8 * 3 + 1 * 1 + (64 + 1) * 3,  # full rows, columns, last row, then the 65 candidates
      "candidates": 64 + 1, "weights": 8 + 5 * 8}
  assert router["router_aux"] == {
      "total": 74 + 144 + 80 + 132 + 175 + 144 + 100 + 198 + 2 + 72,
      "f": 8 + 66, "P": 2 * 9 * 8, "P_scale": 8 + 9 * 8, "load_balance": 66 + 65 + 1,
      "normaliser": 5 * (1 + 2 * 9 + 2 * 8), "p_squared": 2 * 9 * 8, "p_squared_scale": 19 + 8 + 72 + 1,
      "mse": 2 * 66 + 65 + 1, "z": 2, "entropy": 4 * (1 + 9 + 8)}
  # with the aux-free bias the choice expands the grid and takes the top k of every chapter
  aux_free = _config(66, 1, overrides={**sequence, "memory.load_balance": "aux_free"})
  choice = flops.estimate(aux_free, 1, 128)["memory_layer"]["memory"]["router"]
  assert (choice["grid"], choice["top_k"]) == (9 * 8, 66 * 3) and "candidates" not in choice
  linear = flops.estimate(_config(66, 1, "linear", sequence), 1, 128)["memory_layer"]["memory"]["router"]
  assert "grid" not in linear and linear["linear"] == 2 * 64 * 66


def test_flops_of_a_large_bank_grow_with_the_grid_not_the_logits():
  """Per-position routing over 4,096 routable chapters: the product router's count is a small fraction of the
  linear router's, whose [d, C] map, softmax and top-k run over every chapter at every position."""
  big = {"memory.num_chapters": 4097, "memory.num_tokens": 4097 * 16, "memory.routing": "prefix"}
  product, linear = (flops.estimate(moc_jax.load_config(TINY, {**big, "memory.router": r}), 1, 128)
                     ["memory_layer"]["memory"] for r in ("product", "linear"))
  total = lambda m: m["router"]["total"] + m["router_aux"]["total"]
  assert total(product) < total(linear) / 10


def test_unknown_router_is_one_clear_error():
  with pytest.raises(ConfigError, match=r"config\.memory\.router: .*'factorised'"):
    moc_jax.load_config(TINY, {"memory.router": "factorised"})


def test_mocpt_import_refuses_product_router():
  with pytest.raises(ConfigError, match=r"config\.memory\.router: 'product' has no MoC-PT counterpart"):
    param_map(_config(65, 1))


@pytest.mark.slow  # the whole model; the router's gradients against numpy: test_gradients_match_numpy
def test_model_trains_through_product_router():
  """The whole model: the router's matrices get gradient from the LM loss alone (no router loss; the memory
  output projection starts non-zero, or nothing reaches the router at the first step)."""
  cfg = moc_jax.load_config(TINY, {"memory.router": "product", "memory.load_balance_coef": 0.0,
                                   "memory.z_loss_coef": 0.0, "memory.wo_init_zero": False})
  model = moc_jax.build_model(cfg, seed=0)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(p):
    logits, _ = nnx.merge(graphdef, p)(ids)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
  g = jax.grad(loss)(params)
  router = g["layers"]["blocks"][1]["memory"]["router"]
  assert set(router) == {"rows", "cols", "shared"}
  for part in ("rows", "cols"):
    assert np.all(np.isfinite(router[part]["kernel"][...])) and np.any(router[part]["kernel"][...] != 0)
