"""memory.kind = pkm | hml against float64 numpy restatements written from their definitions (Memory+; MIDUS
Eq. 16-19), float32 compute, fixed seeds.

* The pkm read and the hml block: forward and gradients (values, sub-keys, query or attention, gates or per-head
  maps), every lookup scoring all n^2 slots in numpy; the value table's gradient is the scatter-add of the rows
  read and exactly zero on every other row.
* Parameter counts from their formulas (pkm: N*d_v + per layer the query, 2*H*n*d_k/2 sub-keys and the gate;
  hml: N*d_h + per block H*d_h^2 + the sub-keys + the attention's q, k, v).
* An hml model at initialisation is its backbone: the values are zero, so its logits equal, bit for bit, those
  of the model without memory carrying the same backbone weights.
* Cached decoding (prefill, then one token at a time, a left-padded row among them) equals the full forward.
* The config refuses each bad field with one message naming it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.model import decode
from moc_jax.model.hml import HMLBlock
from moc_jax.model.pkm import PKMLayer
from tests.convert.mocpt_numpy import _self_attention, _silu
from tests.model.test_product_keys import np_lookup

TINY = "configs/moc.py:tiny"
SLOTS = {"memory.pkm_sub_keys": 4, "memory.pkm_top_k": 3, "model.compute_dtype": "float32"}
PKM = {**SLOTS, "memory.kind": "pkm", "memory.pkm_heads": 2, "memory.pkm_key_dim": 8, "memory.pkm_value_dim": 12}
HML = {**SLOTS, "memory.kind": "hml"}
EPS = 1e-5


def config(overrides):
  return moc_jax.load_config(TINY, overrides)


def randomize(module, seed):
  """Every parameter of `module` drawn N(0, 0.5) (a zero-initialised W2 would stop every other gradient)."""
  rng = np.random.default_rng(seed)
  graphdef, state = nnx.split(module)
  state = jax.tree.map(lambda x: jnp.asarray(rng.normal(scale=0.5, size=x.shape).astype(np.float32)), state)
  return nnx.merge(graphdef, state)


def np_rms(x, scale):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * scale


def np_keys_backward(q, keys, ids, w, dw):
  """d loss / d sub-keys and / d queries through the chosen slots' softmax weights, given d loss / d weights:
  a slot i*n + j scores its query's first half against row key i plus its second half against column key j."""
  q, keys = q.astype(np.float64), keys.astype(np.float64)
  n, half = keys.shape[2], q.shape[-1] // 2
  dscore = w * (dw - (w * dw).sum(-1, keepdims=True))
  dkeys, dq = np.zeros_like(keys), np.zeros_like(q)
  for idx in np.ndindex(ids.shape):
    *lead, h, _ = idx
    lead = tuple(lead)
    i, j = divmod(int(ids[idx]), n)
    dkeys[h, 0, i] += dscore[idx] * q[lead + (h, slice(0, half))]
    dkeys[h, 1, j] += dscore[idx] * q[lead + (h, slice(half, None))]
    dq[lead + (h, slice(0, half))] += dscore[idx] * keys[h, 0, i]
    dq[lead + (h, slice(half, None))] += dscore[idx] * keys[h, 1, j]
  return dkeys, dq


def scatter_rows(n_rows, ids, contributions):
  """sum of contributions [..., d] into rows ids [...]: numpy's scatter-add."""
  out = np.zeros((n_rows, contributions.shape[-1]))
  np.add.at(out, ids.reshape(-1), contributions.reshape(-1, contributions.shape[-1]))
  return out


def assert_close(got, want, what):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()),
                             err_msg=what)


# --- pkm ------------------------------------------------------------------------------------------

def test_pkm_read_forward_and_gradients_equal_numpy():
  cfg = config(PKM)
  layer = randomize(PKMLayer(cfg, nnx.Rngs(params=0)), 1)
  rng = np.random.default_rng(2)
  h = rng.normal(size=(2, 5, 64)).astype(np.float32)
  table = rng.normal(size=(16, 12)).astype(np.float32)
  cot = rng.normal(size=(2, 5, 64)).astype(np.float32)
  graphdef, params = nnx.split(layer)

  def loss(params, table):
    out, stats = nnx.merge(graphdef, params)(jnp.asarray(h), None, table)
    return jnp.sum(out * cot), (out, stats["slots"])

  (_, (out, slots)), (g_params, g_table) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, jnp.asarray(table))

  p = {"scale": layer.norm.scale[...], "wq": layer.query.kernel[...], "keys": layer.keys.keys[...],
       "w1": layer.gate.kernel[...], "w2": layer.out.kernel[...]}
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x = np_rms(h.astype(np.float64), p["scale"])
  q = (x @ p["wq"]).reshape(2, 5, 2, 8)
  ids, w = np_lookup(q, p["keys"], 3, "none", EPS)
  rows = table.astype(np.float64)[ids]                   # [B, L, H, k, dv]
  y = np.einsum("blhk,blhkd->bld", w, rows)
  z = x @ p["w1"]
  out_np = (y * _silu(z)) @ p["w2"]
  np.testing.assert_array_equal(np.asarray(slots), ids)
  assert_close(out, out_np, "pkm forward")

  g = cot.astype(np.float64)
  d_gated = g @ p["w2"].T
  sigmoid = 1 / (1 + np.exp(-z))
  dy, dz = d_gated * _silu(z), d_gated * y * sigmoid * (1 + z * (1 - sigmoid))  # silu'(z)
  dw = np.einsum("bld,blhkd->blhk", dy, rows)
  dkeys, dq = np_keys_backward(q, p["keys"], ids, w, dw)
  want = {"w2": ((y * _silu(z)).reshape(-1, 12).T @ g.reshape(-1, 64)), "w1": x.reshape(-1, 64).T @ dz.reshape(-1, 12),
          "wq": x.reshape(-1, 64).T @ dq.reshape(-1, 16), "keys": dkeys}
  got = {"w2": g_params["out"]["kernel"][...], "w1": g_params["gate"]["kernel"][...],
         "wq": g_params["query"]["kernel"][...], "keys": g_params["keys"]["keys"][...]}
  for name in want:
    assert_close(got[name], want[name], f"d loss / d {name}")
  d_table = scatter_rows(16, ids, w[..., None] * dy[:, :, None, None, :])
  assert_close(g_table, d_table, "d loss / d values")
  unread = np.setdiff1d(np.arange(16), ids)
  assert unread.size and not np.asarray(g_table)[unread].any()  # rows never read: exactly zero gradient


def test_pkm_ungated_output_is_the_bag_of_values():
  cfg = config({**PKM, "memory.pkm_gated": False, "memory.pkm_value_dim": None})
  layer = randomize(PKMLayer(cfg, nnx.Rngs(params=0)), 3)
  assert not hasattr(layer, "gate")
  rng = np.random.default_rng(4)
  h, table = rng.normal(size=(2, 5, 64)).astype(np.float32), rng.normal(size=(16, 64)).astype(np.float32)
  out, stats = layer(jnp.asarray(h), None, jnp.asarray(table))
  x = np_rms(h.astype(np.float64), np.asarray(layer.norm.scale[...]))
  q = (x @ np.asarray(layer.query.kernel[...], np.float64)).reshape(2, 5, 2, 8)
  ids, w = np_lookup(q, np.asarray(layer.keys.keys[...]), 3, "none", EPS)
  assert_close(out, np.einsum("blhk,blhkd->bld", w, table.astype(np.float64)[ids]), "pkm ungated forward")


# --- hml ------------------------------------------------------------------------------------------

def test_hml_block_forward_and_gradients_equal_numpy():
  cfg = config({**HML, "memory.pkm_sub_keys": 16})  # 256 slots: the 144 reads leave rows unread
  block = randomize(HMLBlock(cfg, nnx.Rngs(params=0)), 5)
  rng = np.random.default_rng(6)
  b, l, d, heads, dh, slots_n = 2, 6, 64, 4, 16, 256
  h = rng.normal(size=(b, l, d)).astype(np.float32)
  table = rng.normal(size=(slots_n, dh)).astype(np.float32)
  cot = rng.normal(size=(b, l, d)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(l), (b, l))
  mask = jnp.tril(jnp.ones((l, l), bool))[None, None]
  graphdef, params = nnx.split(block)

  def loss(params, table):
    out, stats = nnx.merge(graphdef, params)(jnp.asarray(h), table, positions, mask)
    return jnp.sum(out * cot), (out, stats["slots"])

  (_, (out, slots)), (g_params, g_table) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, jnp.asarray(table))

  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  x = np_rms(h.astype(np.float64), f64(block.norm.scale[...]))
  s = {"q_proj.weight": f64(block.attn.q.kernel[...]).T, "k_proj.weight": f64(block.attn.k.kernel[...]).T,
       "v_proj.weight": f64(block.attn.v.kernel[...]).T, "o_proj.weight": np.eye(d),
       "rotary.inv_freq": 1.0 / (cfg.model.rope_theta ** (np.arange(0, dh, 2) / dh))}
  a = _self_attention(x, s, "", {"heads": heads, "kv": 2, "hd": dh}, None, True).reshape(b, l, heads, dh)
  keys, maps = f64(block.keys.keys[...]), f64(block.maps[...])
  ids, w = np_lookup(a, keys, 3, "none", EPS)
  rows = table.astype(np.float64)[ids]                       # [B, L, H, k, dh]
  read = np.einsum("blhk,blhkd->blhd", w, rows)
  out_np = np.einsum("hed,blhd->blhe", maps, read).reshape(b, l, d)
  np.testing.assert_array_equal(np.asarray(slots), ids)
  assert_close(out, out_np, "hml forward")

  g = cot.astype(np.float64).reshape(b, l, heads, dh)
  d_read = np.einsum("hed,blhe->blhd", maps, g)                # W_h^T g_h
  dw = np.einsum("blhd,blhkd->blhk", d_read, rows)
  dkeys, _ = np_keys_backward(a, keys, ids, w, dw)
  assert_close(g_params["maps"][...], np.einsum("blhe,blhd->hed", g, read), "d loss / d W_h")
  assert_close(g_params["keys"]["keys"][...], dkeys, "d loss / d sub-keys")
  d_table = scatter_rows(slots_n, ids, w[..., None] * d_read[:, :, :, None, :])
  assert_close(g_table, d_table, "d loss / d values")
  unread = np.setdiff1d(np.arange(slots_n), ids)
  assert unread.size and not np.asarray(g_table)[unread].any()
  assert not hasattr(block.attn, "o") or block.attn.o is None  # attention without its output projection


def test_hml_model_at_initialisation_is_its_backbone():
  """Zero values: every hml block adds exactly 0, so the model's logits are the backbone's, bit for bit."""
  unrolled = {"model.scan_layers": False, "model.compute_dtype": "float32"}
  hml = moc_jax.build_model(config({**HML, **unrolled}), seed=0)
  backbone = moc_jax.build_model(config({**unrolled, "memory.enabled": False, "memory.placement": "none"}), seed=1)
  assert not np.asarray(hml.bank.memory[...]).any()
  hml.embed, hml.final_norm = backbone.embed, backbone.final_norm
  for mine, theirs in zip(hml.layers.blocks, backbone.layers.blocks):
    mine.attn_norm, mine.attn, mine.mlp_norm, mine.mlp = theirs.attn_norm, theirs.attn, theirs.mlp_norm, theirs.mlp
  ids = jnp.asarray(np.random.default_rng(7).integers(0, 260, (2, 24)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(hml(ids)[0]), np.asarray(backbone(ids)[0]))


@pytest.mark.parametrize("kind", ["pkm", "hml"])
def test_remat_keeps_the_search(kind):
  """Under remat the backward pass recomputes the layers but not the product-key search (the policies keep its slot
  ids): the compiled gradient runs as many top-k searches as the forward (XLA's CPU backend lowers each lax.top_k to
  a TopK call, two per lookup), and its gradients are remat=none's."""
  overrides = {**(PKM if kind == "pkm" else HML), "model.scan_layers": False}
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 260, (2, 24)), jnp.int32)

  def loss_of(remat):
    graphdef, state = nnx.split(randomize(moc_jax.build_model(config({**overrides, "model.remat": remat}), seed=0), 1))
    return (lambda st: jnp.mean(nnx.merge(graphdef, st)(ids)[0] ** 2)), state

  grads = {}
  for remat in ("none", "full", "dots"):
    loss, state = loss_of(remat)
    g = jax.jit(jax.grad(loss)).lower(state).compile()
    if remat == "none":  # the forward's searches: two memory layers x two halves
      assert jax.jit(loss).lower(state).compile().as_text().count('custom_call_target="TopK"') == 4
    assert g.as_text().count('custom_call_target="TopK"') == 4, remat
    grads[remat] = g(state)
  for remat in ("full", "dots"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 grads[remat], grads["none"])


# --- parameter counts -----------------------------------------------------------------------------

@pytest.mark.parametrize("sharing, tables", [("shared", 1), ("per_layer", 2)])
def test_parameter_counts_follow_the_formulas(sharing, tables):
  d, layers, n, k_dim, heads, dv = 64, 2, 4, 8, 2, 12
  pkm = moc_jax.count_params(config({**PKM, "memory.sharing": sharing}))
  assert pkm["bank"] == tables * n * n * dv
  assert pkm["memory_layers"] == layers * (d + d * heads * k_dim + heads * 2 * n * k_dim // 2 + 2 * d * dv)
  h, dh, kv = 4, 16, 2 * 16
  hml = moc_jax.count_params(config({**HML, "memory.sharing": sharing}))
  assert hml["bank"] == tables * n * n * dh                                      # N * d_h per table
  assert hml["memory_layers"] == layers * (h * dh * dh + h * 2 * n * dh // 2     # W_h and the sub-keys
                                           + d + d * d + 2 * d * kv)             # norm; attention q, k, v
  for counts in (pkm, hml):
    assert counts["backbone"] == moc_jax.count_params(config({"memory.enabled": False, "memory.placement": "none"}))[
        "backbone"]


# --- cached decoding ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["pkm", "hml"])
def test_cached_decoding_equals_the_full_forward(kind):
  cfg = config({**(PKM if kind == "pkm" else HML), "memory.pkm_sub_keys": 8, "memory.wo_init_zero": False})
  model = moc_jax.build_model(cfg, seed=0)  # pkm's W2 drawn, not zero: the memory shows in the logits
  if kind == "hml":  # non-zero values, likewise
    model.bank.memory.set_value(jax.random.normal(jax.random.key(1), model.bank.memory[...].shape))
  graphdef, state = nnx.split(model)
  del model
  rng = np.random.default_rng(8)
  ids = rng.integers(0, 260, (2, 12)).astype(np.int32)
  valid = np.ones_like(ids, bool)
  valid[1, :3] = False  # row 1: three slots of left padding
  forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[0][0])
  full = [np.asarray(forward(state, jnp.asarray(ids[:1]))), np.asarray(forward(state, jnp.asarray(ids[1:, 3:])))]

  prefill = jax.jit(lambda state, ids, valid: decode.step(m := nnx.merge(graphdef, state),
                                                         decode.init_cache(m, 2, 12), ids, valid))
  step = jax.jit(lambda state, cache, ids, valid: decode.step(nnx.merge(graphdef, state), cache, ids, valid))
  cache, logits = prefill(state, jnp.asarray(ids[:, :5]), jnp.asarray(valid[:, :5]))
  outs = [logits]
  for t in range(5, 12):  # one token at a time: one compiled step
    cache, logits = step(state, cache, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(valid[:, t:t + 1]))
    outs.append(logits)
  cached = np.concatenate([np.asarray(o) for o in outs], axis=1)
  np.testing.assert_allclose(cached[0], full[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cached[1, 3:], full[1], rtol=1e-5, atol=1e-5)


# --- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    ({"memory.kind": "flat"}, "config.memory.kind"),
    ({**PKM, "memory.pkm_top_k": 17}, "config.memory.pkm_top_k"),
    ({**PKM, "memory.pkm_sub_keys": 0}, "config.memory.pkm_sub_keys"),
    ({**PKM, "memory.pkm_key_dim": 7}, "config.memory.pkm_key_dim"),
    ({**PKM, "memory.pkm_gated": False}, "config.memory.pkm_value_dim"),
    ({**PKM, "memory.pkm_query_norm": "batchnorm"}, "config.memory.pkm_query_norm"),
    ({**HML, "memory.block_variant": "B"}, "config.memory.block_variant"),
    ({**PKM, "train.bank_optimizer": "smf", "train.init_from": "/nowhere"}, "config.train.bank_optimizer"),
])
def test_config_names_the_bad_field(overrides, field):
  with pytest.raises(moc_jax.ConfigError) as e:
    config(overrides)
  assert str(e.value).startswith(field + ":") and "\n" not in str(e.value), str(e.value)
