"""Causal routing modes (token / prefix / chunk): what each decision sees, the causality probe, the
identities that pin them to sequence routing, and their config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import causality
from moc_jax.config import routing_statement
from moc_jax.errors import ConfigError
from moc_jax.model.memory import per_position, routing_input

TINY = "configs/moc.py:tiny"


def _cfg(**overrides):
  return moc_jax.load_config(TINY, {"model.compute_dtype": "float32", **overrides})


SEED = 20261128  # fixed: a failure reproduces, and a pass does not depend on the draw


def _numpy_routing_input(h, valid, routing, chunk):
  """Float64 loop over decisions: the masked mean of the positions each decision may see."""
  b, l, _ = h.shape
  starts = range(l) if routing == "prefix" else range(0, l, chunk)
  out = []
  for t in starts:
    seen = np.arange(t + 1) if routing == "prefix" else np.arange(t)  # chunk: strictly before the chunk
    w = valid[:, seen].astype(np.float64)
    total = np.einsum("bl,bld->bd", w, h[:, seen].astype(np.float64))
    out.append(total / np.maximum(w.sum(1), 1)[:, None])
  return np.stack(out, axis=1)


@pytest.mark.parametrize("routing, chunk", [("prefix", 1), ("chunk", 4), ("chunk", 5), ("chunk", 1)])
def test_routing_input_is_the_masked_mean_of_what_the_decision_may_see(routing, chunk):
  seed = SEED
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(3, 13, 6)).astype(np.float32)
  valid = np.ones((3, 13), bool)
  valid[0, 9:] = False          # right padding
  valid[1, :4] = False          # left padding: nothing seen yet -> zeros (the router bias alone)
  ours = np.asarray(routing_input(jnp.asarray(h), jnp.asarray(valid), routing, chunk))
  np.testing.assert_allclose(ours, _numpy_routing_input(h, valid, routing, chunk), rtol=1e-5, atol=1e-6,
                             err_msg=f"seed {seed}")
  if routing == "chunk":
    assert not ours[:, 0].any()  # chunk 0 sees nothing
    spread = np.asarray(per_position(jnp.asarray(ours), routing, chunk, 13))
    assert spread.shape[1] == 13 and all(np.array_equal(spread[:, t], ours[:, t // chunk]) for t in range(13))


@pytest.mark.parametrize("routing", ["token", "prefix", "chunk"])
def test_causal_modes_leave_the_past_exactly_unchanged(routing):
  result = causality.probe(_cfg(**{"memory.routing": routing, "memory.routing_chunk": 8}), length=32, seed=SEED)
  assert result["causal"] and result["max_change_all"] == 0.0, result
  assert result["causal_by_design"]


def test_sequence_routing_leaks_the_future_and_the_probe_sees_it():
  result = causality.probe(_cfg(**{"memory.routing": "sequence"}), length=32, seed=SEED)
  assert not result["causal_by_design"]
  assert result["max_change_all"] > 0.0, result  # documented leak (a causal model gives exactly 0.0)


def _models(routing, seed, **extra):
  """A `sequence` model and a `routing` model with identical (re-drawn, non-zero) parameters."""
  models = []
  for r in ("sequence", routing):
    model = moc_jax.build_model(_cfg(**{"memory.routing": r, **extra}), seed=seed)
    causality._redraw_zeros(model, seed + 1)
    models.append(model)
  return models


@pytest.mark.slow
def test_prefix_position_t_reads_what_sequence_routing_reads_on_the_first_t_tokens():
  """With one memory layer, the last: at t, prefix routing = the sequence model run on tokens[:t+1].
  (With an earlier memory layer the positions before t would differ too: they routed on less.)"""
  seed = SEED
  seq, prefix = _models("prefix", seed, **{"memory.layer_indices": (3,)})
  tokens = np.random.default_rng(seed).integers(1, 260, (2, 24))
  full = np.asarray(prefix(jnp.asarray(tokens))[0])
  for t in (0, 5, 11, 23):
    short = np.asarray(seq(jnp.asarray(tokens[:, :t + 1]))[0])
    np.testing.assert_allclose(full[:, t], short[:, t], rtol=2e-5, atol=2e-5, err_msg=f"t={t}, seed {seed}")


def test_chunk_mode_routes_chunk_zero_on_the_router_bias_and_later_chunks_on_their_past():
  """Chunk 0 sees nothing: the router bias alone picks it. With one memory layer, chunk c picks what the
  sequence model picks on the c x 8 tokens before it (an identity, so it holds for every seed)."""
  seed = SEED
  seq, chunked = _models("chunk", seed, **{"memory.routing_chunk": 8, "memory.layer_indices": (3,)})
  tokens = np.random.default_rng(seed).integers(1, 260, (2, 24))
  chapters = np.asarray(chunked(jnp.asarray(tokens))[1]["chapters"])  # [n_mem, B, chunks, s+k]
  assert chapters.shape[:3] == (1, 2, 3)
  bias = np.asarray(chunked.layers.blocks[3].memory.router.proj.bias[...])  # one group: not scanned, [C]
  routed = set(np.argsort(-bias[1:])[:8] + 1)
  assert all(set(chapters[0, b, 0, 1:]) == routed for b in range(2))
  for c in (1, 2):
    past = np.asarray(seq(jnp.asarray(tokens[:, :8 * c]))[1]["chapters"])  # [n_mem, B, s+k]
    np.testing.assert_array_equal(chapters[0, :, c], past[0], err_msg=f"chunk {c}, seed {seed}")


def test_per_position_modes_train_the_router_through_the_chapter_weights():
  seed = SEED
  for routing in ("prefix", "chunk"):  # token: its router gradient is compared with MoC-PT's (test_parity.py)
    model = moc_jax.build_model(_cfg(**{"memory.routing": routing, "memory.routing_chunk": 4}), seed=seed)
    causality._redraw_zeros(model, seed + 1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(1, 260, (2, 16)))

    def loss(p):
      logits, _ = nnx.merge(graphdef, p, rest)(tokens)
      return jnp.mean(logits[..., 3])  # no router loss: the gradient must come through the read

    grads = jax.grad(loss)(params)
    router = grads["layers"]["blocks"][1]["memory"]["router"]["proj"]["kernel"][...]
    bank = grads["bank"]["memory"][...]
    assert np.abs(np.asarray(router)).max() > 0, routing
    assert np.abs(np.asarray(bank)).max() > 0, routing


@pytest.mark.parametrize("overrides, field", [
    ({"memory.routing": "rolling"}, "config.memory.routing"),
    ({"memory.routing": "chunk", "memory.routing_chunk": 0}, "config.memory.routing_chunk"),
    ({"memory.attention_impl": "triton"}, "config.memory.attention_impl"),
])
def test_bad_routing_fields_are_rejected_by_name(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    _cfg(**overrides)


def test_training_log_states_whether_the_run_is_causal():
  assert "NOT causal" in routing_statement(_cfg(**{"memory.routing": "sequence"}))
  for routing in ("token", "prefix", "chunk"):
    line = routing_statement(_cfg(**{"memory.routing": routing}))
    assert "causal" in line and "NOT" not in line and routing in line
  assert routing_statement(moc_jax.load_config("configs/vanilla.py:tiny")) == "no memory layers: causal"


# slow: the kernel against its reference is tests/kernels/test_pallas.py's (default suite); this is the model around it
@pytest.mark.parametrize("routing", [pytest.param(r, marks=pytest.mark.slow) for r in ("token", "prefix")])
def test_the_model_reads_the_same_through_the_pallas_kernel_and_the_xla_fallback(routing):
  """Whole-model loss and gradients with attention_impl=pallas (TPU kernels, interpret mode) vs xla."""
  seed = SEED
  tokens = jnp.asarray(np.random.default_rng(seed).integers(1, 260, (2, 16)))
  results = []
  for impl in ("xla", "pallas"):
    model = moc_jax.build_model(_cfg(**{"memory.routing": routing, "memory.attention_impl": impl}), seed=seed)
    causality._redraw_zeros(model, seed + 1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
      logits, aux = nnx.merge(graphdef, p, rest)(tokens)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 7]) + aux["router_loss"]

    results.append(jax.value_and_grad(loss)(params))
  (loss_x, grads_x), (loss_p, grads_p) = results
  np.testing.assert_allclose(loss_p, loss_x, rtol=1e-6, err_msg=f"seed {seed}")
  for (path, gx), (_, gp) in zip(nnx.to_flat_state(grads_x), nnx.to_flat_state(grads_p)):
    gx, gp = np.asarray(gx[...]), np.asarray(gp[...])
    assert np.linalg.norm(gp - gx) <= 1e-5 * max(np.linalg.norm(gx), 1e-12), (path, seed)


@pytest.mark.parametrize("routing", ["token", pytest.param("chunk", marks=pytest.mark.slow)])
def test_small_calls_project_only_the_chapters_they_name(routing):
  """Fewer (decision, slot) pairs than chapters -> only the distinct chapters named are projected;
  the result equals projecting the whole bank."""
  seed = SEED
  cfg = _cfg(**{"memory.routing": routing, "memory.routing_chunk": 4, "memory.attention_impl": "reference"})
  model = moc_jax.build_model(cfg, seed=seed)
  causality._redraw_zeros(model, seed + 1)
  stacked, bank = model.layers.blocks[1].memory, model.bank.memory[...][0]  # scanned: group 0's layer
  layer = nnx.merge(nnx.graphdef(stacked), jax.tree.map(lambda x: x[0], nnx.state(stacked)))
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(1, 6, 64)).astype(np.float32))  # 6 positions x 8 slots < 65 chapters
  small, _ = layer(h, h, bank)
  pairs = (6 if routing == "token" else 2) * 8
  assert pairs < bank.shape[0]
  k, v, ids = layer.keys_values_in_use(bank, jnp.zeros((pairs,), jnp.int32))
  assert k.shape[0] == pairs  # the small path was taken
  full_k, full_v, _ = layer.keys_values_in_use(bank, jnp.zeros((bank.shape[0],), jnp.int32))
  assert full_k.shape[0] == bank.shape[0]
  # the same layer forced onto the whole bank: repeat the 6 positions so the call names >= 65 pairs
  big, _ = layer(jnp.tile(h, (12, 1, 1)), jnp.tile(h, (12, 1, 1)), bank)
  np.testing.assert_allclose(np.asarray(small[0]), np.asarray(big[0]), rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
