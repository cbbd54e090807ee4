"""The sparse bank gradient of `train.bank_optimizer=lazy_adam` (model.memory.BankRows, step._rows_per_bank).

Through the real model under every routing mode: the gradient on the rows equals the dense bank gradient
(scattered back) and the loss is the same; the per-bank combination of rows against a numpy scatter-add; and
the compiled train step's temporaries do not grow with the bank, where the dense step's do; the bank's optimizer
state in host memory takes the same updates.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import checkpoint as ckpt_lib
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.config import bank_ids
from moc_jax.losses import lm_loss
from moc_jax.train import step as step_lib
from tests.asserts import assert_same_bytes
from tests.train.train_utils import random_batch

SMALL = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2}


def packed(config, seed):
  """Two packed documents per row (segment ids 1, 2; the last 4 positions padding)."""
  rows = random_batch(config, seed)
  seg = np.ones_like(rows["input_ids"])
  seg[:, 12:] = 2
  seg[:, -4:] = 0
  rows["attention_mask"] = (seg > 0).astype(np.int32)
  rows["labels"] = np.where(seg > 0, rows["input_ids"], -100)
  rows["segment_ids"] = seg
  return rows


@pytest.mark.parametrize("routing,sharing", [  # the three read paths by default: per row, joint per position, moe
    ("sequence", "shared"), ("prefix", "per_layer"), ("token", "shared"),
    pytest.param("segment", "per_layer", marks=pytest.mark.slow), pytest.param("chunk", "shared", marks=pytest.mark.slow)])
def test_rows_gradient_equals_the_dense_bank_gradient(routing, sharing):
  """Bank gradient via zero deltas on the rows each memory layer reads, scattered back, vs jax.grad of the
  bank (W_o not zero, so the bank has a gradient); shared sharing runs the layers under scan, per_layer (two
  banks) unrolled. The two are different float32 programs summing the same terms in their own orders: an element
  may differ by the rounding of a sum whose terms reach the largest gradient, a few float32 epsilons of it (a
  wrong row, scale or missing read differs by the gradients themselves)."""
  config = moc_jax.load_config("configs/moc.py:tiny", {**SMALL, "memory.routing": routing, "memory.sharing": sharing,
                                                      "memory.routing_chunk": 8, "memory.wo_init_zero": False})
  graphdef, params = nnx.split(moc_jax.build_model(config), nnx.Param)
  rows = jax.tree.map(jnp.asarray, packed(config, 0))
  table = params["bank"]["memory"][...]

  def dense(p):
    loss, (_, aux) = lm_loss(nnx.merge(graphdef, p), rows, train=True)
    return loss, aux["chapters"]

  (want_loss, chapters), grads = jax.jit(jax.value_and_grad(dense, has_aux=True))(params)
  k = min(table.shape[1], int(np.prod(chapters.shape[1:])) + config.memory.num_shared)
  deltas = jnp.zeros((chapters.shape[0], k) + table.shape[2:], table.dtype)

  def sparse(d):
    loss, (_, aux) = lm_loss(nnx.merge(graphdef, params), rows, train=True, bank_deltas=d)
    return loss, aux["rows"]

  (got_loss, used), g = jax.jit(jax.value_and_grad(sparse, has_aux=True))(deltas)
  scattered = np.zeros(table.shape, np.float64)
  for layer, bank in enumerate(bank_ids(config)):
    ids = np.asarray(used[layer])
    keep = ids < table.shape[1]
    assert len(set(ids[keep])) == keep.sum() and not np.any(np.asarray(g[layer])[~keep])
    np.add.at(scattered[bank], ids[keep], np.asarray(g[layer], np.float64)[keep])
  want = np.asarray(grads["bank"]["memory"][...])
  assert np.any(want != 0)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
  np.testing.assert_allclose(scattered, want, rtol=1e-5, atol=4 * np.finfo(np.float32).eps * np.abs(want).max())


def test_rows_per_bank_sums_duplicates_like_a_scatter_add():
  """Three memory layers (banks 0, 1, 0) and two micro-batches naming overlapping chapters (9 = none)."""
  rng = np.random.default_rng(0)
  accum, layers, k, chapters = 2, 3, 5, 9
  rows = np.stack([[np.sort(rng.choice(chapters + 1, k, replace=False)) for _ in range(layers)]
                   for _ in range(accum)]).astype(np.int32)
  grads = rng.standard_normal((accum, layers, k, 2, 3)).astype(np.float32)
  grads[rows == chapters] = 0
  ids_of = (0, 1, 0)
  got = step_lib._rows_per_bank(jnp.asarray(rows), jnp.asarray(grads), ids_of, chapters)
  for b in range(2):
    want = np.zeros((chapters + 1, 2, 3), np.float64)
    for a in range(accum):
      for layer in range(layers):
        if ids_of[layer] == b:
          np.add.at(want, rows[a, layer], grads[a, layer].astype(np.float64))
    ids, values = np.asarray(got[b].ids), np.asarray(got[b].values, np.float64)
    real = ids < chapters
    assert len(set(ids[real])) == real.sum()
    assert set(ids[real]) == set(rows[:, [i for i in range(layers) if ids_of[i] == b]].reshape(-1)) - {chapters}
    dense = np.zeros_like(want)
    dense[ids[real]] = values[real]
    np.testing.assert_allclose(dense[:chapters], want[:chapters], rtol=1e-6, atol=1e-7)


def _temp_bytes(chapters, overrides):
  """(temporary bytes of the compiled train step, the bank's bytes) for the tiny model with `chapters` chapters
  of 128 tokens, so that the router, dense by design (its [64, chapters] weights per memory layer and, routed per
  token, its [64 positions, chapters] logits), is small beside the bank's 128 x 64 floats a chapter."""
  config = moc_jax.load_config("configs/moc.py:tiny", {**SMALL, "memory.num_tokens": chapters * 128,
                                                      "memory.num_chapters": chapters, **overrides})
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    data = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data)
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=data) for k, v in random_batch(config, 0).items()}
    compiled = step.lower(layout.abstract, abstract_batch).compile()
  bank = layout.abstract["params"]["bank"]["memory"]
  return compiled.memory_analysis().temp_size_in_bytes, int(np.prod(bank.shape)) * 4


@pytest.mark.parametrize("routing", ["sequence", pytest.param("token", marks=pytest.mark.slow)])
def test_the_lazy_steps_temporaries_do_not_grow_with_the_bank(routing):
  """From 1,025 to 4,097 chapters of 128 x 64 float32 (a 33.6 MB bank to 134 MB) at the same read, the compiled
  lazy_adam step's temporaries grow by under a fifth of the bank's growth (what grows is the router, O(chapters
  x d): its weights, and its logits per decision; routed per token on a CPU, whose unrolled layer loop keeps both
  memory layers' logits live, 10.3 MB whether a chapter holds 64 tokens or 128); the dense step's (its bank
  gradient, AdamW over the bank) grow by more than the bank does."""
  (lazy_small, bank_small), (lazy_big, bank_big) = (
      _temp_bytes(c, {"train.bank_optimizer": "lazy_adam", "memory.routing": routing}) for c in (1025, 4097))
  dense_small, dense_big = (_temp_bytes(c, {"memory.routing": routing})[0] for c in (1025, 4097))
  growth = bank_big - bank_small
  assert lazy_big - lazy_small < growth / 5, (lazy_small, lazy_big)
  assert dense_big - dense_small > growth, (dense_small, dense_big)


def _three_updates(overrides, tmp_path=None):
  """The tiny model's state after three lazy_adam updates (two micro-batches each) on one device, and the
  state restored from a checkpoint of it when `tmp_path` is given. Routed per sequence, so that some chapters are
  never read (tiny's prefix routing reads every one in one update)."""
  config = moc_jax.load_config("configs/moc.py:tiny", {**SMALL, "train.grad_accum": 2, "train.warmup_steps": 1,
                                                      "memory.routing": "sequence", "train.bank_optimizer": "lazy_adam",
                                                      **overrides})
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    data = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data)
    for s in range(3):
      state, _ = step(state, jax.device_put(random_batch(config, s), data))
    restored = None
    if tmp_path is not None:
      ck = ckpt_lib.Checkpointer(str(tmp_path), padding=layout.padding)
      try:
        ck.save(3, state)
        ck.wait()
        restored = ck.restore(3, layout.abstract)
      finally:
        ck.close()
  return state, restored


@pytest.mark.slow
def test_bank_state_in_host_memory_takes_the_same_updates(tmp_path):
  """train.bank_state_memory=pinned_host: the bank's moments and counts live in host memory, the update reads
  and writes their rows there, and three updates give the bytes of the on-device state; a checkpoint restores
  them into host memory."""
  host, restored = _three_updates({"train.bank_state_memory": "pinned_host"}, tmp_path)
  device, _ = _three_updates({})
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(host["opt_state"].bank)}
  assert kinds == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(host["params"])} == {"device"}
  assert np.any(np.asarray(jax.tree.leaves(host["opt_state"].bank.count)[0]) == 0)  # a sparse read
  assert_same_bytes(jax.tree.map(np.asarray, {k: host[k] for k in ("params", "opt_state")}),
                    jax.tree.map(np.asarray, {k: device[k] for k in ("params", "opt_state")}))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(restored["opt_state"].bank)} == {"pinned_host"}
  assert_same_bytes(jax.tree.map(np.asarray, restored["opt_state"]), jax.tree.map(np.asarray, host["opt_state"]))


@pytest.mark.parametrize("overrides, error", [
    ({"train.bank_optimizer": "dense"}, r"train\.bank_state_memory: 'pinned_host' with train\.bank_optimizer='dense'"),
    ({"mesh.memory": 2, "num_fake_devices": 2}, r"train\.bank_state_memory: 'pinned_host' with the bank's chapters split 2 ways"),
    ({"train.bank_state_memory": "gpu_hbm"}, r"train\.bank_state_memory: unknown value 'gpu_hbm'"),
])
def test_bank_state_memory_is_refused_where_it_cannot_work(overrides, error):
  with pytest.raises(moc_jax.ConfigError, match=error):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "lazy_adam",
                                                "train.bank_state_memory": "pinned_host", **overrides})
