"""`memory.router=product` against float64 numpy restatements and hand counts: its logits and gradients, its
grid, its parameter and FLOPs counts, the config's refusal of an unknown router and the MoC-PT import's refusal
of a router MoC-PT does not have."""
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
from moc_jax.model.routing import Router

TINY = "configs/moc.py:tiny"


def _config(chapters, shared, router="product"):
  return moc_jax.load_config(TINY, {"memory.num_chapters": chapters, "memory.num_tokens": chapters * 16,
                                    "memory.num_shared": shared, "memory.router": router,
                                    "memory.top_k": min(8, chapters - shared),
                                    "model.compute_dtype": "float32"})


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


def test_parameter_count_by_hand():
  """Per memory layer the router holds (s + a + b)(d + 1) values instead of C(d + 1); nothing else changes."""
  linear, product = (moc_jax.count_params(_config(66, 1, r)) for r in ("linear", "product"))
  d, layers = 64, 2  # tiny: d_model 64, memory at layers 1 and 3
  assert product["memory_layers"] == linear["memory_layers"] - layers * (66 - (1 + 9 + 8)) * (d + 1)
  assert {k: v for k, v in product.items() if k not in ("memory_layers", "total")} == \
      {k: v for k, v in linear.items() if k not in ("memory_layers", "total")}


def test_flops_by_hand():
  """Sequence routing, B = 1: 2·d·(s + a + b) for the three matrices and a·b adds for the grid."""
  cfg = _config(66, 1)
  router = flops.estimate(cfg, 1, 128)["memory_layer"]["memory"]["router"]
  assert router["linear"] == 2 * 64 * (1 + 9 + 8) and router["grid"] == 9 * 8
  linear = flops.estimate(_config(66, 1, "linear"), 1, 128)["memory_layer"]["memory"]["router"]
  assert "grid" not in linear and linear["linear"] == 2 * 64 * 66
  assert router["total"] - router["linear"] - router["grid"] == linear["total"] - linear["linear"]


def test_unknown_router_is_one_clear_error():
  with pytest.raises(ConfigError, match=r"config\.memory\.router: .*'factorised'"):
    moc_jax.load_config(TINY, {"memory.router": "factorised"})


def test_mocpt_import_refuses_product_router():
  with pytest.raises(ConfigError, match=r"config\.memory\.router: 'product' has no MoC-PT counterpart"):
    param_map(_config(65, 1))


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
