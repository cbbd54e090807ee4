"""Sequence router, chapter mixing and router losses against float64 numpy references (docs/mocpt_semantics.md: router, mixing, losses)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moc_jax.model import memory


@functools.partial(jax.jit, static_argnums=(3,))
def router_losses(logits, probs, ids, num_shared):
  return memory.router_losses(logits, probs, ids, num_shared, "mocpt")


@functools.partial(jax.jit, static_argnums=(1, 2))
def route_and_losses(logits, num_shared, top_k):
  """One compile per shape (eager dispatch would compile every primitive separately)."""
  probs, ids, w = memory.route(logits, num_shared, top_k)
  return probs, ids, w, memory.router_losses(logits, probs, ids, num_shared, "mocpt")


mix_weights = jax.jit(memory.mix_weights, static_argnums=(1, 2))
normalize_tokens = jax.jit(memory.normalize_tokens, static_argnums=(1, 2))


def _logits(rng, b, c, spread=3.0):
  """Random [B, C] float32 logits whose values differ by >= 1e-3 within a row, so the top-k set is
  unambiguous in float32 and float64 alike (a random permutation of jittered, evenly spaced values)."""
  step = spread / c
  assert step >= 2e-3
  grid = (np.arange(c) - c / 2) * step
  rows = [rng.permutation(grid + rng.uniform(-0.25, 0.25, c) * step) for _ in range(b)]
  return np.stack(rows).astype(np.float32)


def _softmax64(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _route64(z, s, k):
  """Reference: top-k of the routed chapters by logit, weights = softmax restricted to the set."""
  z = np.asarray(z, np.float64)
  ids = s + np.argsort(-z[:, s:], axis=-1, kind="stable")[:, :k]
  zs = np.take_along_axis(z, ids, -1)
  w = np.exp(zs - zs.max(-1, keepdims=True))
  return _softmax64(z), ids, w / w.sum(-1, keepdims=True)


CASES = [(b, c, s, k, seed) for seed, (b, c, s, k) in enumerate([
    (1, 8, 0, 1), (2, 17, 2, 5), (4, 65, 1, 8), (5, 65, 0, 65), (2, 129, 3, 16),
    (2, 300, 5, 64), (6, 40, 39, 1), (1, 1000, 1, 64)])]


@pytest.mark.parametrize("b,c,s,k,seed", CASES)
def test_route_matches_numpy_topk(b, c, s, k, seed):
  rng = np.random.default_rng(1000 + seed)
  z = _logits(rng, b, c, spread=min(6.0, c * 2e-3 * 3))
  z[:, :s] += 5.0  # shared chapters are the most probable and must still never be routed
  probs, ids, w, _ = route_and_losses(jnp.asarray(z), s, k)
  ref_p, ref_ids, ref_w = _route64(z, s, k)
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(probs), ref_p, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(w), ref_w, rtol=2e-5, atol=1e-7)
  assert ids.dtype in (jnp.int32, jnp.int64)
  assert np.all(np.asarray(ids) >= s)
  # sorted by descending probability
  p_sel = np.take_along_axis(ref_p, np.asarray(ids), -1)
  assert np.all(np.diff(p_sel, axis=-1) < 0)


@pytest.mark.parametrize("s,k,f", [(1, 64, 2.5), (2, 8, 5.0), (0, 5, 1.0), (3, 4, 0.0), (1, 1, 2.5)])
def test_mix_weights_formula(s, k, f):
  """raw = [1]*s + [f*w]; divided by s + f (the sum, since the routed weights sum to 1)."""
  rng = np.random.default_rng(k * 10 + s)
  w = rng.dirichlet(np.ones(k), size=3)
  out = np.asarray(mix_weights(jnp.asarray(w, jnp.float32), s, f))
  ref = np.concatenate([np.ones((3, s)), f * w], -1) / (s + f)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)
  if s == 1 and f == 2.5:  # the paper's 1 / 3.5 shared weight
    np.testing.assert_allclose(out[:, 0], 1 / 3.5, rtol=1e-6)


def _losses64(z, ids):
  z = np.asarray(z, np.float64)
  b, c = z.shape
  p = _softmax64(z)
  f = np.zeros(c)
  for row in ids:
    f[row] += 1.0 / b
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  return {
      "f": f,
      "load_balance": c * np.sum(f * p.mean(0)),
      "z_loss": np.mean(lse ** 2),
      "mse_aux": np.mean(((p ** 2).mean(0) - 1.0 / c) ** 2),
      "entropy": np.mean(-(p * np.log(np.maximum(p, 1e-12))).sum(-1)),
  }


@pytest.mark.parametrize("b,c,s,k,seed", CASES)
def test_router_losses_match_numpy(b, c, s, k, seed):
  rng = np.random.default_rng(2000 + seed)
  z = _logits(rng, b, c, spread=min(6.0, c * 2e-3 * 3)) + rng.normal(0, 2.0, (b, 1)).astype(np.float32)
  _, ids, _, losses = route_and_losses(jnp.asarray(z), s, k)
  out = {k_: float(v) for k_, v in losses.items() if v.ndim == 0}
  ref = _losses64(z, np.asarray(ids))
  assert ref["f"][:s].sum() == 0 and np.isclose(ref["f"].sum(), k)
  for name in ("load_balance", "z_loss", "mse_aux", "entropy"):
    np.testing.assert_allclose(out[name], ref[name], rtol=5e-5, atol=1e-9, err_msg=name)


def test_load_balance_at_uniform_router_is_k():
  """At a uniform router LB = C * k * (1/C) = k (64 for the paper model); z-loss = ln(C)^2."""
  c, s, k = 4097, 1, 64
  z = jnp.zeros((2, c))
  probs = jax.nn.softmax(z)
  ids = jnp.stack([jnp.arange(s, s + k), jnp.arange(s + k, s + 2 * k)])
  out = router_losses(z, probs, ids, s)
  np.testing.assert_allclose(float(out["load_balance"]), k, rtol=1e-5)
  np.testing.assert_allclose(float(out["z_loss"]), np.log(c) ** 2, rtol=1e-5)


@pytest.mark.parametrize("b,c,s,k,seed", CASES[1:5])
def test_load_balance_gradient_only_through_p(b, c, s, k, seed):
  """d LB / d z_{b,j} = (C/B) p_{b,j} (f_j - sum_i f_i p_{b,i}): f is a constant (no gradient)."""
  rng = np.random.default_rng(3000 + seed)
  z = _logits(rng, b, c, spread=min(6.0, c * 2e-3 * 3))

  def lb(logits):
    probs, ids, _ = memory.route(logits, s, k)
    return memory.router_losses(logits, probs, ids, s, "mocpt")["load_balance"]

  grad = np.asarray(jax.jit(jax.grad(lb))(jnp.asarray(z)))
  p = _softmax64(z)
  f = _losses64(z, _route64(z, s, k)[1])["f"]
  ref = (c / b) * p * (f[None] - (p * f[None]).sum(-1, keepdims=True))
  np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-7 * c / b)


def test_load_balance_linear_in_p_when_selection_fixed():
  """With the top-k set unchanged, LB changes by exactly C * sum_i f_i dP_i (f frozen)."""
  rng = np.random.default_rng(7)
  b, c, s, k = 4, 65, 1, 8
  z0 = _logits(rng, b, c, spread=0.4)
  z1 = z0.copy()
  # shift the shared logit and every logit outside the selected set down: ranking of S is unchanged
  ids0 = _route64(z0, s, k)[1]
  outside = np.ones_like(z0, bool)
  np.put_along_axis(outside, ids0, False, -1)
  z1[outside] -= rng.uniform(0.0, 1.0, outside.sum()).astype(np.float32)
  assert np.array_equal(_route64(z1, s, k)[1], ids0)

  def lb(z):
    _, ids, _, losses = route_and_losses(jnp.asarray(z), s, k)
    np.testing.assert_array_equal(np.asarray(ids), ids0)
    return float(losses["load_balance"])

  f = _losses64(z0, ids0)["f"]
  dP = _softmax64(z1).mean(0) - _softmax64(z0).mean(0)
  np.testing.assert_allclose(lb(z1) - lb(z0), c * np.sum(f * dP), rtol=1e-3)


def test_shared_mass_lowers_load_balance():
  """Documents MoC-PT's load-balance quirk: P counts the shared chapter (f = 0), so raising its logit lowers LB."""
  rng = np.random.default_rng(11)
  z = _logits(rng, 4, 65, spread=0.4)
  vals = []
  for boost in (0.0, 2.0, 8.0):
    zb = z.copy()
    zb[:, 0] += boost
    vals.append(float(route_and_losses(jnp.asarray(zb), 1, 8)[3]["load_balance"]))
  assert vals[0] > vals[1] > vals[2]


def _norm64(x, kind, eps):
  x = np.asarray(x, np.float64)
  if kind == "rms":
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps)


@pytest.mark.parametrize("kind", ["rms", "layernorm"])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_normalize_tokens(kind, eps):
  rng = np.random.default_rng(int(eps * 1e5) + len(kind))
  x = (rng.normal(0.3, 1.0, (2, 5, 16, 48)) * rng.uniform(0.05, 3.0, (2, 5, 16, 1))).astype(np.float32)
  out = normalize_tokens(jnp.asarray(x), kind, eps)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), _norm64(x, kind, eps), rtol=2e-5, atol=2e-6)
  np.testing.assert_array_equal(np.asarray(normalize_tokens(jnp.asarray(x), "none", eps)), x)


def _memory_layer64(p, h, route_input, bank, cfg):
  """Float64 reference of one memory read (MoC-PT's order): route on the layer input, gather
  [shared, routed...] chapters, parameter-free token norm (skipped without shared chapters), scale
  every token by its chapter weight, then one joint softmax over all selected tokens."""
  m, mem = cfg.model, cfg.memory
  s, k, f = mem.num_shared, mem.top_k, mem.routed_scaling_factor
  z = route_input.mean(1) @ p["router_w"] + p["router_b"]
  _, ids, w = _route64(z, s, k)
  b = z.shape[0]
  chapters = np.concatenate([np.tile(np.arange(s), (b, 1)), ids], -1)
  mix = np.concatenate([np.ones((b, s)), f * w], -1) / (s + f)
  sel = bank[chapters]  # [B, s+k, T, dm]
  if s > 0 and mem.token_norm != "none":
    sel = _norm64(sel, mem.token_norm, mem.token_norm_eps)
  sel = (sel * mix[:, :, None, None]).reshape(b, -1, sel.shape[-1])
  x = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + m.norm_eps) * p["norm"]
  hd = m.d_model // mem.num_heads
  q = (x @ p["q"]).reshape(b, h.shape[1], mem.num_heads, hd)
  kk = (sel @ p["k"]).reshape(b, sel.shape[1], mem.num_kv_heads, hd)
  vv = (sel @ p["v"]).reshape(b, sel.shape[1], mem.num_kv_heads, hd)
  g = mem.num_heads // mem.num_kv_heads
  kk, vv = np.repeat(kk, g, 2), np.repeat(vv, g, 2)
  sc = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(hd)
  a = np.exp(sc - sc.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", a, vv).reshape(b, h.shape[1], -1) @ p["o"]
  return out, chapters, mix, z


@pytest.mark.parametrize("overrides", [
    {},
    {"memory.token_norm": "layernorm", "memory.num_shared": 2, "memory.routed_scaling_factor": 5.0,
     "memory.num_kv_heads": 2, "memory.dim": 48},
    {"memory.num_shared": 0, "memory.top_k": 6},
])
def test_memory_layer_matches_numpy(overrides):
  from flax import nnx

  import moc_jax
  cfg = moc_jax.load_config("configs/moc.py:tiny", {"model.compute_dtype": "float32", "memory.routing": "sequence",
                                                   "memory.load_balance": "mocpt", **overrides})  # MoC-PT's mode
  layer = memory.MemoryLayer(cfg, nnx.Rngs(params=0))
  rng = np.random.default_rng(len(overrides))
  d, mem = cfg.model.d_model, cfg.memory
  md = mem.dim or d
  t = mem.num_tokens // mem.num_chapters
  p = {"router_w": rng.normal(0, 0.3, (d, mem.num_chapters)), "router_b": rng.normal(0, 1.0, mem.num_chapters),
       "norm": rng.normal(1, 0.3, d), "q": rng.normal(0, 0.2, (d, d)),
       "k": rng.normal(0, 0.2, (md, layer.attn.k.kernel.shape[1])),
       "v": rng.normal(0, 0.2, (md, layer.attn.v.kernel.shape[1])), "o": rng.normal(0, 0.2, (d, d))}
  p = {k_: v.astype(np.float32) for k_, v in p.items()}
  for var, key in [(layer.router.proj.kernel, "router_w"), (layer.router.proj.bias, "router_b"),
                   (layer.norm.scale, "norm"), (layer.attn.q.kernel, "q"), (layer.attn.k.kernel, "k"),
                   (layer.attn.v.kernel, "v"), (layer.attn.o.kernel, "o")]:
    assert var.get_value().shape == p[key].shape, key
    var.set_value(jnp.asarray(p[key]))
  h = rng.normal(0, 1, (2, 8, d)).astype(np.float32)
  route_input = rng.normal(0, 1, (2, 8, d)).astype(np.float32)
  bank = (rng.normal(0, 0.02, (mem.num_chapters, t, md)) * rng.uniform(0.2, 5, (mem.num_chapters, t, 1)))
  bank = bank.astype(np.float32)

  out, stats = nnx.jit(lambda m, *a: m(*a))(layer, *map(jnp.asarray, (h, route_input, bank)))
  p64 = {k_: v.astype(np.float64) for k_, v in p.items()}
  ref, chapters, mix, z = _memory_layer64(p64, h.astype(np.float64), route_input.astype(np.float64),
                                          bank.astype(np.float64), cfg)
  zs = np.sort(z[:, mem.num_shared:], -1)[:, ::-1]
  assert (zs[:, mem.top_k - 1] - zs[:, mem.top_k] > 1e-4).all()  # the top-k set is unambiguous
  np.testing.assert_array_equal(np.asarray(stats["chapters"]), chapters)
  np.testing.assert_allclose(np.asarray(stats["weights"]), mix, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
