"""Backbone blocks against float64 numpy, and the masking properties of the whole model."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.model import layers

F32 = {"model.compute_dtype": "float32"}

rope = jax.jit(layers.rope, static_argnums=(2,))


def _rope64(x, pos, theta):
  """Rotate-half RoPE: inv_freq = theta^(-arange(0,d,2)/d), frequencies duplicated to d."""
  x = np.asarray(x, np.float64)
  d = x.shape[-1]
  inv_freq = theta ** (-np.arange(0, d, 2) / d)
  emb = np.concatenate([pos[..., None] * inv_freq] * 2, -1)[:, :, None, :]
  rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  return x * np.cos(emb) + rot * np.sin(emb)


@pytest.mark.parametrize("d,theta", [(8, 10_000.0), (64, 100_000.0), (32, 500.0)])
def test_rope_matches_numpy(d, theta):
  rng = np.random.default_rng(d)
  x = rng.normal(size=(2, 24, 3, d)).astype(np.float32)
  pos = np.stack([rng.permutation(64)[:24], np.arange(24)]).astype(np.int32)  # arbitrary positions per row
  out = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), theta))
  np.testing.assert_allclose(out, _rope64(x, pos.astype(np.float64), theta), rtol=1e-5, atol=2e-5)


def test_rope_scores_depend_only_on_offset():
  """<rope(q, m), rope(k, n)> is a function of m - n: shifting both positions leaves scores unchanged."""
  rng = np.random.default_rng(1)
  q, k = (rng.normal(size=(1, 16, 2, 32)).astype(np.float32) for _ in range(2))
  pos = np.arange(16, dtype=np.int32)[None]

  def scores(shift):
    p = jnp.asarray(pos + shift)
    return np.einsum("bqhd,bkhd->bhqk", np.asarray(rope(jnp.asarray(q), p, 10_000.0), np.float64),
                     np.asarray(rope(jnp.asarray(k), p, 10_000.0), np.float64))

  np.testing.assert_allclose(scores(0), scores(37), rtol=1e-4, atol=1e-4)


def _attention64(q, k, v, mask):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, lq, h, d = q.shape
  g = h // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # torch repeat_interleave: head h -> kv h // g
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
  if mask is not None:
    s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, lq, h * d)


def _masks(rng, b, lq, lk):
  """Causal AND random key padding, key 0 always kept so no row is empty; [B, 1, Lq, Lk]."""
  pad = rng.uniform(size=(b, lk)) > 0.35
  pad[:, 0] = True
  causal = np.tril(np.ones((lq, lk), bool))
  return causal[None, None] & pad[:, None, None, :]


FORMULATIONS = [layers.attention_token_major, layers.attention_heads_major]  # `attention` takes one by platform


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_attention_gqa_masks(h, hkv, formulation):
  attention = jax.jit(formulation)
  rng = np.random.default_rng(h * 10 + hkv)
  b, l, d = 2, 12, 8
  q = rng.normal(size=(b, l, h, d)).astype(np.float32)
  k, v = (rng.normal(size=(b, l, hkv, d)).astype(np.float32) for _ in range(2))
  mask = _masks(rng, b, l, l)
  out = np.asarray(attention(*map(jnp.asarray, (q, k, v, mask))))
  np.testing.assert_allclose(out, _attention64(q, k, v, mask), rtol=1e-5, atol=1e-5)
  out_nomask = np.asarray(attention(*map(jnp.asarray, (q, k, v))))
  np.testing.assert_allclose(out_nomask, _attention64(q, k, v, None), rtol=1e-5, atol=1e-5)

  # masked keys get exactly zero probability: arbitrary k/v there cannot change the output
  k2, v2 = k.copy(), v.copy()
  hidden = ~mask[:, 0].any(1)  # keys masked for every query, [B, Lk]
  hidden |= ~mask[:, 0, l // 2]  # plus the ones masked for the middle query only
  for bi in range(b):
    k2[bi, hidden[bi]] = rng.normal(0, 50, k2[bi, hidden[bi]].shape)
    v2[bi, hidden[bi]] = rng.normal(0, 1e3, v2[bi, hidden[bi]].shape)
  out2 = np.asarray(attention(*map(jnp.asarray, (q, k2, v2, mask))))
  np.testing.assert_array_equal(out2[:, l // 2], out[:, l // 2])


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_attention_head_grouping_is_interleaved(formulation):
  """Query head h reads kv head h // (H/Hkv): zeroing kv head 1 changes query heads 2,3 only (H=4, Hkv=2)."""
  attention = jax.jit(formulation)
  rng = np.random.default_rng(5)
  q = rng.normal(size=(1, 6, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(1, 6, 2, 8)).astype(np.float32) for _ in range(2))
  base = np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))).reshape(1, 6, 4, 8)
  v2 = v.copy()
  v2[:, :, 1] = 0
  new = np.asarray(attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v2))).reshape(1, 6, 4, 8)
  np.testing.assert_array_equal(new[:, :, :2], base[:, :, :2])
  np.testing.assert_array_equal(new[:, :, 2:], 0)


@pytest.mark.parametrize("eps", [1e-5, 1e-1])
def test_rmsnorm(eps):
  rng = np.random.default_rng(3)
  norm = layers.RMSNorm(48, eps)
  w = rng.normal(1.0, 0.5, 48).astype(np.float32)
  norm.scale.value = jnp.asarray(w)
  x = (rng.normal(0.2, 1.0, (3, 7, 48)) * rng.uniform(0.01, 4.0, (3, 7, 1))).astype(np.float32)
  ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w
  np.testing.assert_allclose(np.asarray(nnx.jit(lambda n, x: n(x))(norm, jnp.asarray(x))), ref,
                             rtol=2e-5, atol=2e-6)


def test_swiglu():
  cfg = moc_jax.load_config("configs/moc.py:tiny", F32)
  mlp = layers.MLP(cfg, nnx.Rngs(params=0))
  rng = np.random.default_rng(4)
  x = rng.normal(size=(2, 5, cfg.model.d_model)).astype(np.float32)
  wg, wu, wd = (np.asarray(m.kernel.value, np.float64) for m in (mlp.gate, mlp.up, mlp.down))
  assert wg.shape == wu.shape == (64, 192) and wd.shape == (192, 64)
  g = x @ wg
  ref = ((g / (1 + np.exp(-g))) * (x @ wu)) @ wd
  out = np.asarray(nnx.jit(lambda m, x: m(x))(mlp, jnp.asarray(x)))
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)


PLAIN = {"silu": lambda u: u / (1 + np.exp(-u)), "relu": lambda u: np.maximum(u, 0),
         "gelu": lambda u: 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2))),
         "sigmoid": lambda u: 1 / (1 + np.exp(-u)), "tanh": np.tanh}


def test_every_hidden_activation_the_config_accepts_is_built_and_counted():
  from moc_jax import flops
  from moc_jax.config.schema import HIDDEN_ACTIVATIONS
  assert set(HIDDEN_ACTIVATIONS) == {"swiglu", *layers.PLAIN_ACTIVATIONS} == {"swiglu", *flops.PLAIN_ACTIVATION}
  assert set(PLAIN) == set(layers.PLAIN_ACTIVATIONS)  # each one checked below against numpy


@pytest.mark.parametrize("activation", sorted(PLAIN))
def test_a_plain_mlp_has_no_gate_and_applies_its_activation_between_up_and_down(activation):
  cfg = moc_jax.load_config("configs/moc.py:tiny", {**F32, "model.hidden_activation": activation})
  mlp = layers.MLP(cfg, nnx.Rngs(params=0))
  assert not hasattr(mlp, "gate")
  x = np.random.default_rng(5).normal(size=(2, 5, cfg.model.d_model)).astype(np.float32)
  wu, wd = (np.asarray(m.kernel.value, np.float64) for m in (mlp.up, mlp.down))
  ref = PLAIN[activation](x @ wu) @ wd
  out = np.asarray(nnx.jit(lambda m, x: m(x))(mlp, jnp.asarray(x)))
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)


# ---- model-level masking properties (tiny models shared via conftest) ---------------------------

def test_vanilla_model_is_causal(vanilla_tiny):
  rng = np.random.default_rng(6)
  v = vanilla_tiny.cfg.model.vocab_size
  ids = rng.integers(0, v, (2, 16))
  t = 11
  ids2 = ids.copy()
  ids2[:, t:] = (ids[:, t:] + rng.integers(1, v, (2, 16 - t))) % v
  a, b = (np.asarray(vanilla_tiny(x)[0]) for x in (ids, ids2))
  np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
  assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-3


def test_moc_sequence_routing_is_not_causal(moc_tiny_mocpt_routing):
  """Documents MoC-PT's sequence router: the router pools the whole sequence, so a later token changes earlier logits.

  W_o of the memory attention is zero at init (the memory read is then a no-op), so it is randomised.
  """
  model = nnx.clone(moc_tiny_mocpt_routing.model)
  o = model.layers.blocks[moc_tiny_mocpt_routing.cfg.memory.layer_indices[0] % 2].memory.attn.o.kernel
  o.value = 0.05 * jax.random.normal(jax.random.key(0), o.value.shape)
  state = nnx.split(model)[1]
  rng = np.random.default_rng(7)
  v = moc_tiny_mocpt_routing.cfg.model.vocab_size
  ids = rng.integers(0, v, (2, 16))
  ids2 = ids.copy()
  ids2[:, -1] = (ids[:, -1] + 1) % v
  a, b = (np.asarray(moc_tiny_mocpt_routing(x, state=state)[0]) for x in (ids, ids2))
  assert np.abs(a[:, 0] - b[:, 0]).max() > 1e-4
  # with the initial (zero) memory W_o the same change is invisible at position 0
  a0, b0 = (np.asarray(moc_tiny_mocpt_routing(x)[0]) for x in (ids, ids2))
  np.testing.assert_allclose(a0[:, 0], b0[:, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("pad_side", ["left", "right", "middle"])
def test_vanilla_key_padding(vanilla_tiny, pad_side):
  """Logits at real positions ignore the ids at padded positions (left padding is the non-trivial case:
  there the causal mask alone would let real positions see the pads)."""
  rng = np.random.default_rng(8)
  l, v = 16, vanilla_tiny.cfg.model.vocab_size
  real = np.ones((2, l), np.int32)
  sl = {"left": slice(0, 5), "right": slice(11, l), "middle": slice(6, 9)}[pad_side]
  real[:, sl] = 0
  ids = rng.integers(0, v, (2, l))
  ids2 = ids.copy()
  ids2[:, sl] = (ids[:, sl] + rng.integers(1, v, ids[:, sl].shape)) % v
  a, b = (np.asarray(vanilla_tiny(x, real)[0]) for x in (ids, ids2))
  keep = real.astype(bool)
  np.testing.assert_allclose(a[keep], b[keep], rtol=0, atol=1e-6)
  # without the mask the pad ids do leak (except with right padding, which causality already hides)
  if pad_side != "right":
    a0, b0 = (np.asarray(vanilla_tiny(x)[0]) for x in (ids, ids2))
    assert np.abs(a0[keep] - b0[keep]).max() > 1e-4
