"""Attention-pooled routing (`memory.routing_pool=attention`): the position weights and every pooled routing
input against float64 numpy, a zero query giving the plain mean bit for bit, causality, the query's gradient,
its FLOPs by hand and the config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import causality, flops
from moc_jax.errors import ConfigError
from moc_jax.model.routing import POOL_SCORE_CAP, pool_share, pool_weights, routing_input

TINY = "configs/moc.py:tiny"
SEGMENTS = np.array([[1] * 4 + [2] * 6 + [3] * 3, [5] * 13])


def _cfg(**overrides):
  return moc_jax.load_config(TINY, {"model.compute_dtype": "float32", "memory.routing_pool": "attention",
                                    **overrides})


def _numpy_weights(h, valid, query, eps=1e-6):
  h = h.astype(np.float64)
  s = (h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps)) @ query.astype(np.float64)
  return np.exp(POOL_SCORE_CAP * np.tanh(s / POOL_SCORE_CAP)) * valid


def _numpy_pooled(h, w, routing, chunk, segments):
  """Float64 loop: per position, sum(w h) / sum(w) over the positions of its document its decision may see."""
  b, length, _ = h.shape
  docs = np.zeros((b, length), int) if segments is None else segments
  out = np.zeros(h.shape, np.float64)
  for r in range(b):
    for t in range(length):
      same = np.cumsum(np.r_[True, docs[r, 1:] != docs[r, :-1]])  # run number of each position
      seen = (same == same[t]) & {"segment": np.ones(length, bool), "prefix": np.arange(length) <= t,
                                  "chunk": np.arange(length) < t // chunk * chunk}[routing]
      total = w[r, seen].sum()
      out[r, t] = (w[r, seen, None] * h[r, seen]).sum(0) / total if total > 0 else 0.0
  return out


def test_pool_weights_are_the_capped_exponential_of_the_query_score():
  rng = np.random.default_rng(0)
  h = 3.0 * rng.normal(size=(2, 7, 8)).astype(np.float32)
  valid = np.ones((2, 7), bool)
  valid[1, :2] = False
  query = 4.0 * rng.normal(size=8).astype(np.float32)  # scores beyond the cap, so the tanh bound acts
  ours = np.asarray(pool_weights(jnp.asarray(h), jnp.asarray(valid), jnp.asarray(query), 1e-6))
  want = _numpy_weights(h, valid, query)
  np.testing.assert_allclose(ours, want, rtol=2e-5)
  assert ours.max() <= np.exp(POOL_SCORE_CAP) * (1 + 1e-6) and not ours[1, :2].any()
  assert want.max() / want[want > 0].min() > 1e4  # the test spans a wide range of weights


@pytest.mark.parametrize("routing, chunk, packed", [("prefix", 1, False), ("prefix", 1, True), ("segment", 1, False),
                                                    ("segment", 1, True), ("chunk", 4, False), ("chunk", 3, True)])
def test_weighted_routing_input_is_the_weighted_mean_of_what_each_decision_may_see(routing, chunk, packed):
  rng = np.random.default_rng(1)
  h = rng.normal(size=(2, 13, 6)).astype(np.float32)
  w = np.exp(3.0 * rng.normal(size=(2, 13))).astype(np.float32)
  w[0, 10:] = 0.0  # padding weighs nothing
  segments = SEGMENTS if packed else None
  ours = np.asarray(routing_input(jnp.asarray(h), jnp.asarray(w > 0), routing, chunk,
                                  None if segments is None else jnp.asarray(segments), jnp.asarray(w)))
  want = _numpy_pooled(h, w.astype(np.float64), routing, chunk, segments)
  if routing == "chunk" and not packed:
    want = want[:, ::chunk]  # one decision per chunk
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)


def test_weighted_sequence_routing_is_the_rows_weighted_mean():
  rng = np.random.default_rng(2)
  h = rng.normal(size=(2, 9, 4)).astype(np.float32)
  w = np.exp(rng.normal(size=(2, 9))).astype(np.float32)
  w[1, 6:] = 0.0
  ours = np.asarray(routing_input(jnp.asarray(h), None, "sequence", 1, None, jnp.asarray(w)))
  want = np.einsum("bl,bld->bd", w.astype(np.float64), h) / w.sum(1, dtype=np.float64)[:, None]
  np.testing.assert_allclose(ours, want, rtol=1e-5)


def test_pool_share_is_one_for_a_plain_mean_and_one_over_n_for_one_position():
  w = np.ones((2, 8), np.float32)
  w[1, 5:] = 0.0  # three pads: the share counts the five real positions
  assert float(pool_share(jnp.asarray(w))) == pytest.approx(1.0, rel=1e-6)
  one = np.full((1, 4), np.exp(-POOL_SCORE_CAP), np.float32)
  one[0, 2] = np.exp(POOL_SCORE_CAP)
  p = np.asarray(one[0], np.float64) / one.sum()
  want = np.exp(-(p * np.log(p)).sum()) / 4
  assert float(pool_share(jnp.asarray(one))) == pytest.approx(want, rel=1e-5) and want < 0.26


def _logits(cfg, ids, valid):
  model = moc_jax.build_model(cfg, seed=3)
  logits, aux = model(ids, valid)
  return np.asarray(logits), np.asarray(aux["chapters"])


@pytest.mark.parametrize("routing", ["prefix", "chunk"])
def test_a_zero_query_routes_exactly_as_the_plain_mean(routing):
  """The query starts at zero: every weight is exp(0) = 1, so the model is the mean-pooled one, bit for bit."""
  ids = jnp.asarray(np.random.default_rng(4).integers(1, 256, (2, 24)), jnp.int32)
  valid = jnp.asarray(np.arange(24)[None] < np.array([[24], [17]]))
  common = {"memory.routing": routing, "memory.routing_chunk": 8, "memory.wo_init_zero": False}
  mean = _logits(moc_jax.load_config(TINY, {"model.compute_dtype": "float32", **common}), ids, valid)
  attention = _logits(_cfg(**common), ids, valid)
  np.testing.assert_array_equal(attention[0], mean[0])
  np.testing.assert_array_equal(attention[1], mean[1])


@pytest.mark.parametrize("routing", ["prefix", "chunk"])
def test_attention_pooled_causal_routing_leaves_the_past_exactly_unchanged(routing):
  """The probe redraws every zero parameter, the query included, so the weights vary with the tokens."""
  result = causality.probe(_cfg(**{"memory.routing": routing, "memory.routing_chunk": 8}), length=32, seed=5)
  assert result["causal"] and result["max_change_all"] == 0.0, result


@pytest.mark.slow  # gradients through training steps; the pooling itself is checked against numpy above
def test_the_query_learns_from_the_router_loss_and_the_memory_read():
  cfg = _cfg(**{"memory.routing": "prefix", "memory.wo_init_zero": False, "memory.load_balance": "routed"})
  model = moc_jax.build_model(cfg, seed=0)
  ids = jnp.asarray(np.random.default_rng(6).integers(1, 256, (2, 16)), jnp.int32)

  def loss(m, aux_only):
    logits, aux = m(ids[:, :-1], jnp.ones_like(ids[:, :-1]))
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))
    return jnp.sum(aux["router_loss"]) + (0.0 if aux_only else ce)

  for aux_only in (True, False):
    grads = nnx.grad(loss)(model, aux_only)
    q = [np.asarray(v[...]) for p, v in nnx.to_flat_state(grads) if "pool_query" in map(str, p)]
    assert len(q) == 1 and q[0].shape == (2, 64) and np.all(np.abs(q[0]).sum(-1) > 0)


def test_flops_of_attention_pooling_by_hand():
  """Per position of every memory layer: RMS norm 4d + 4, the query dot 2d, weight 5, weighting d."""
  b, l, d = 3, 50, 64
  mean = flops.estimate(moc_jax.load_config(TINY, {"memory.routing": "prefix"}), b, l)
  attention = flops.estimate(_cfg(**{"memory.routing": "prefix"}), b, l)
  per_layer = b * l * ((4 * d + 4) + 2 * d + 5 + d)
  assert attention["forward"]["total"] - mean["forward"]["total"] == 2 * per_layer  # memory layers 1 and 3
  assert attention["forward"]["matmul"] - mean["forward"]["matmul"] == 2 * b * l * 2 * d


def test_config_checks_name_the_field():
  with pytest.raises(ConfigError, match=r"config\.memory\.routing_pool: attention pooling with token routing"):
    moc_jax.build_model(_cfg(**{"memory.routing": "token"}))
  with pytest.raises(ConfigError, match=r"config\.memory\.routing_pool: unknown value 'max'"):
    moc_jax.build_model(_cfg(**{"memory.routing_pool": "max"}))
