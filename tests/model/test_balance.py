"""Router balancing beyond MoC-PT's loss: the routed-only Switch loss (value and gradient against float64 numpy),
the aux-free bias (its update on hand-made counts, its effect on the choice only, and its life in the train step)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.data import make_train_iterator
from moc_jax.model.routing import balance_bias_step, route, router_losses
from moc_jax.train.step import make_train_step


def _softmax64(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _routed_balance64(z, ids, s):
  """R * sum_i share_i * P_i over the R routable chapters: share of routed selections, mean routable softmax."""
  r = z.shape[-1] - s
  counts = np.bincount(ids.reshape(-1) - s, minlength=r).astype(np.float64)
  share = counts / counts.sum()
  p = _softmax64(z[:, s:])
  return r * np.sum(share * p.mean(0)), share, p


@functools.partial(jax.jit, static_argnums=(1, 2))
def _routed_balance(z, s, k):
  probs, ids, _ = route(z, s, k)
  return router_losses(z, probs, ids, s, "routed")["load_balance"], ids


@pytest.mark.parametrize("b,c,s,k", [(4, 65, 1, 8), (3, 17, 2, 5), (6, 40, 0, 3), (2, 129, 3, 16)])
def test_routed_balance_loss_and_gradient_match_numpy(b, c, s, k):
  rng = np.random.default_rng(b * 100 + c)
  z = rng.normal(0, 1.5, (b, c)).astype(np.float32)
  value, ids = _routed_balance(jnp.asarray(z), s, k)
  ref, share, p = _routed_balance64(z, np.asarray(ids), s)
  np.testing.assert_allclose(float(value), ref, rtol=1e-5)
  # d/dz_{b,j} = (R/B) p_{b,j} (share_j - sum_i share_i p_{b,i}) on routable logits; 0 on shared ones
  grad = np.asarray(jax.jit(jax.grad(lambda x: _routed_balance(x, s, k)[0]))(jnp.asarray(z)))
  ref_grad = np.zeros_like(grad, np.float64)
  ref_grad[:, s:] = (c - s) / b * p * (share[None] - (p * share[None]).sum(-1, keepdims=True))
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def test_routed_balance_is_one_when_uniform_and_ignores_shared_mass():
  """Uniform routable softmax and uniform selections give exactly 1; unlike MoC-PT's term, raising the shared
  logit changes nothing (the shared chapter is not part of the balance)."""
  c, s = 65, 1
  ids = jnp.asarray(np.arange(64).reshape(8, 8) + s)
  for shared_logit in (0.0, 5.0, 20.0):
    z = jnp.zeros((8, c)).at[:, 0].set(shared_logit)
    out = jax.jit(router_losses, static_argnums=(3, 4))(z, jax.nn.softmax(z), ids, s, "routed")
    np.testing.assert_allclose(float(out["load_balance"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(out["shared_mass"]), float(jax.nn.softmax(z)[0, 0]), rtol=1e-6)


def test_balance_bias_step_on_hand_made_counts():
  """Underused chapters rise by the rate, overused ones fall, chapters at the mean and shared ones stay."""
  load = jnp.asarray([[7.0, 3.0, 0.0, 1.0, 4.0, 2.0], [9.0, 2.0, 2.0, 2.0, 2.0, 2.0]])  # chapter 0 shared
  step = np.asarray(balance_bias_step(load, 1, 0.01))
  r = np.float32(0.01)
  np.testing.assert_array_equal(step, np.array([[0, -r, r, r, -r, 0], [0] * 6], np.float32))


def test_the_bias_moves_the_choice_never_the_weights():
  rng = np.random.default_rng(5)
  b, c, s, k = 6, 33, 1, 4
  z = rng.normal(0, 1.0, (b, c)).astype(np.float32)
  bias = rng.normal(0, 2.0, c).astype(np.float32)
  probs, ids, w = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(z), s, k, jnp.asarray(bias))
  ref_ids = s + np.argsort(-(z[:, s:] + bias[s:]), axis=-1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)
  np.testing.assert_allclose(np.asarray(w), _softmax64(np.take_along_axis(z, ref_ids, -1)), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(probs), _softmax64(z), rtol=1e-6)  # the losses see the unbiased router
  assert not np.array_equal(np.asarray(ids), np.asarray(route(jnp.asarray(z), s, k)[1]))  # the bias mattered
  # a bias that keeps the choice leaves everything bit-identical
  same = jax.jit(route, static_argnums=(1, 2))(jnp.asarray(z), s, k, jnp.full((c,), 3.0))
  for a, b_ in zip(same, route(jnp.asarray(z), s, k)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def _aux_free_config(data_dir, accum):
  return moc_jax.load_config("configs/moc.py:tiny", {
      "memory.load_balance": "aux_free", "memory.aux_free_rate": 0.01, "memory.load_balance_coef": 0.0,
      "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 4, "train.grad_accum": accum,
      "data.data_dir": str(data_dir), "data.facts.num_entities": 40, "data.facts.num_docs": 200,
      "data.facts.num_val_docs": 20})


def _biases(params):
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(params) if "balance_bias" in map(str, path)}


@pytest.mark.slow  # the whole train step; the bias rule is test_balance_bias_step_on_hand_made_counts's
def test_train_step_moves_the_bias_by_the_whole_updates_loads_outside_the_optimizer(tmp_path):
  """With 2 micro-batches, every bias moves by rate * sign(mean - load) of the selections summed over both
  (counted here by a separate forward on the whole batch), although AdamW with weight decay 0.1 updates every
  trained parameter; a second step moves it again from there."""
  config = _aux_free_config(tmp_path, accum=2)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    step = jax.jit(make_train_step(layout.graphdef, layout.tx, config))
    batches = make_train_iterator(state_lib.micro_batch_config(config), process_index=0, process_count=1)
    for _ in range(2):
      batch = {k: jnp.asarray(v) for k, v in next(batches).items() if k != "n_malformed"}
      before = _biases(state["params"])
      _, aux = jax.jit(lambda p, b: nnx.merge(layout.graphdef, p)(
          b["input_ids"], b.get("attention_mask"), segment_ids=b.get("segment_ids"), positions=b.get("positions")))(
              state["params"], batch)
      load = np.asarray(aux["load"])  # [n_mem (= scanned groups), C]
      state, _ = step(state, batch)
      (path, after), = _biases(state["params"]).items()
      routable = load[:, 1:]
      expected = np.zeros_like(load)
      expected[:, 1:] = 0.01 * np.sign(routable.mean(-1, keepdims=True) - routable)
      np.testing.assert_allclose(after - before[path], expected, rtol=0, atol=1e-8)  # weight decay would be 1e-7
      assert np.abs(after - before[path]).max() == np.float32(0.01)
