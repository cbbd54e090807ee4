"""`train.bank_optimizer=lazy_adam` (optim.LazyBankOptimizer): AdamW over the chapters an update read.

Against a float64 numpy lazy AdamW on random sparse masks and against dense AdamW when every chapter is read,
both for the masked update (a dense bank gradient) and the row update (a sparse one); unread chapters
bit-identical; through the real jitted train step (the mask from the routing decisions,
counts per chapter, the gradient's support inside the mask, a skipped non-finite update); a checkpoint round
trip; and a chapter-sharded bank on 4 fake devices in a fresh process (padded chapters never move).
"""
import functools
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import moc_jax
from moc_jax import checkpoint as ckpt_lib
from moc_jax import optim, sharding
from moc_jax import state as state_lib
from moc_jax.config import bank_ids
from moc_jax.losses import lm_loss
from moc_jax.train import step as step_lib
from tests.train import train_utils as tu
from tests.asserts import assert_same_bytes
from tests.sharding.test_mesh import run_json

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def lazy_state(opt_state) -> optim.LazyAdamState:
  """The bank's LazyAdamState inside a LazyBankOptimizer's state."""
  return opt_state.bank


def bank_leaf(tree):
  """The one array of a bank-group tree (the bank's parameter, moment or counts), as numpy."""
  (leaf,) = jax.tree.leaves(tree)
  return np.asarray(leaf)


# --- the transform against float64 numpy ------------------------------------------------------------------

def numpy_lazy_adamw(p, grads, masks, lr):
  """float64 lazy AdamW, written from its definition: per chapter, a read takes one AdamW step (bias
  correction by that chapter's reads so far, decoupled weight decay); an unread chapter stays as it was."""
  p = p.astype(np.float64)
  m, v, n = np.zeros_like(p), np.zeros_like(p), np.zeros(p.shape[:2], np.int64)
  for g, mask in zip(grads, masks):
    r = mask[:, :, None, None]
    n = n + mask
    m = np.where(r, B1 * m + (1 - B1) * g, m)
    v = np.where(r, B2 * v + (1 - B2) * g * g, v)
    k = np.maximum(n, 1)[:, :, None, None]
    step = m / (1 - B1 ** k) / (np.sqrt(v / (1 - B2 ** k)) + EPS) + WD * p
    p = np.where(r, p - lr * step, p)
  return p, m, v, n


def rows_of(bank_grad, mask):
  """The sparse form of a bank gradient that is zero outside `mask`: per bank the masked chapters, sorted,
  then slots naming chapter C (nothing), C slots in all."""
  c = mask.shape[1]
  out = []
  for b in range(mask.shape[0]):
    ids = jnp.sort(jnp.where(mask[b], jnp.arange(c), c))
    out.append(optim.SparseRows(ids, bank_grad[b].take(ids, axis=0, mode="fill", fill_value=0)))
  return out


def lazy_apply(tx, params, state, grads, mask, sparse):
  """One LazyBankOptimizer update from a gradient tree: the bank's part dense (masked update) or as rows."""
  bank_grad = grads["bank"]["memory"][...]
  rest = optim.without_bank(grads)
  bank_grad = rows_of(bank_grad, mask) if sparse else bank_grad
  norm = tx.global_norm(rest, bank_grad)
  return tx.apply(params, state, rest, bank_grad, jnp.asarray(mask), norm, jnp.isfinite(norm))


@pytest.mark.parametrize("sparse", [False, True], ids=["masked", "rows"])
def test_lazy_adamw_equals_float64_numpy_on_random_sparse_reads(sparse):
  """Six updates of a [2, 7, 3, 4] bank under random masks (gradient zero outside them, as a real step's is);
  chapter (0, 0) is first read at update 5 (its bias correction must be a first step's) and chapter (1, 6)
  never (it must not move). The masked update and the gather/step/scatter of rows both."""
  rng = np.random.default_rng(0)
  steps, lr, shape = 6, 1e-2, (2, 7, 3, 4)
  p0 = rng.standard_normal(shape).astype(np.float32)
  masks = rng.random((steps, 2, 7)) < 0.4
  masks[:4, 0, 0], masks[4, 0, 0], masks[:, 1, 6] = False, True, False
  grads = rng.standard_normal((steps, *shape)).astype(np.float32) * masks[..., None, None]
  tx = optim.LazyBankOptimizer(optax.sgd(0.0), lambda s: -lr, 0.0, B1, B2, EPS, WD)
  params = nnx.State({"bank": {"memory": jnp.asarray(p0)}, "other": {"w": jnp.zeros(3)}})
  state = tx.init(params)
  update = jax.jit(functools.partial(lazy_apply, tx, sparse=sparse))
  for g, mask in zip(grads, masks):
    params, state = update(params, state, nnx.State({"bank": {"memory": g}, "other": {"w": np.zeros(3, np.float32)}}),
                           mask)
  want_p, want_m, want_v, want_n = numpy_lazy_adamw(p0, grads, masks, lr)
  lazy = state.bank
  np.testing.assert_array_equal(bank_leaf(lazy.count), want_n)
  np.testing.assert_allclose(bank_leaf(lazy.mu), want_m, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(bank_leaf(lazy.nu), want_v, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(bank_leaf(params["bank"]), want_p, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(bank_leaf(params["bank"])[1, 6], p0[1, 6])
  assert int(state.count) == steps


# --- inside make_optimizer on the tiny model ---------------------------------------------------------------

def tiny_optimizer(**overrides):
  """(params, tx) of the float32 tiny model with a nonzero LR from update 2 and clipping that bites."""
  c = moc_jax.load_config("configs/moc.py:tiny", {"model.compute_dtype": "float32", "train.warmup_steps": 1,
                                                  "train.bank_lr": 2e-3, **overrides})
  _, params = nnx.split(moc_jax.build_model(c), nnx.Param)
  return params, optim.make_optimizer(c.train, params)


def random_grads(params, seed, mask=None):
  """Random gradients; with `mask` [banks, chapters] the bank's is zero outside it (as a real step's is)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  grads = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
  if mask is not None:
    bank = grads["bank"]["memory"]
    bank.set_value(bank[...] * jnp.asarray(mask)[..., None, None])
  return grads


def run_updates(params, tx, masks, sparse=False):
  """Params and optimizer state after each update (random gradients). A dense optax chain takes `None` masks;
  a LazyBankOptimizer moves the chapters of each mask, from the bank's gradient as a dense array or as rows."""
  opt = tx.init(params)
  update = jax.jit(lambda g, o, p: tx.update(g, o, p))
  lazy = jax.jit(functools.partial(lazy_apply, tx, sparse=sparse))
  history = []
  for i, mask in enumerate(masks):
    if mask is None:
      updates, opt = update(random_grads(params, i), opt, params)
      params = optax.apply_updates(params, updates)
    else:
      params, opt = lazy(params, opt, random_grads(params, i, mask), mask)
    history.append((params, opt))
  return history


@pytest.mark.parametrize("sparse", [pytest.param(False, id="masked", marks=pytest.mark.default_backend),
                                    pytest.param(True, id="rows")])
def test_every_chapter_read_every_update_equals_dense_adamw(sparse):
  """With an all-true mask lazy Adam is AdamW: every parameter (the rest of the model too), the bank's
  moments, and counts equal to the number of updates."""
  params, dense_tx = tiny_optimizer()
  _, lazy_tx = tiny_optimizer(**{"train.bank_optimizer": "lazy_adam"})
  steps, chapters = 3, params["bank"]["memory"].shape[:2]
  dense, dense_opt = run_updates(params, dense_tx, [None] * steps)[-1]
  lazy, lazy_opt = run_updates(params, lazy_tx, [np.ones(chapters, bool)] * steps, sparse)[-1]
  assert jax.tree.structure(lazy) == jax.tree.structure(dense)
  for a, b in zip(jax.tree.leaves(lazy), jax.tree.leaves(dense)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
  adam = dense_opt[-1].inner_states["bank"].inner_state[0]
  state = lazy_state(lazy_opt)
  np.testing.assert_allclose(bank_leaf(state.mu), bank_leaf(adam.mu), rtol=1e-6, atol=1e-12)
  np.testing.assert_allclose(bank_leaf(state.nu), bank_leaf(adam.nu), rtol=1e-6, atol=1e-12)
  assert np.all(bank_leaf(state.count) == steps)
  assert not np.array_equal(bank_leaf(lazy["bank"]), bank_leaf(params["bank"]))


def test_unread_chapters_keep_values_and_moments_bit_identical():
  """Each update, a chapter outside the mask keeps its value, moments and count bit for bit (weight decay
  and clipping on), while every chapter inside it moves once the LR is nonzero; the rows form equals the masked
  form to float32 rounding."""
  params, tx = tiny_optimizer(**{"train.bank_optimizer": "lazy_adam"})
  rng = np.random.default_rng(1)
  masks = rng.random((4, *params["bank"]["memory"].shape[:2])) < 0.3
  bank = bank_leaf(params["bank"])
  before = (bank, np.zeros_like(bank), np.zeros_like(bank), np.zeros(masks.shape[1:], np.int32))
  masked = run_updates(params, tx, masks)
  for i, (p, opt) in enumerate(run_updates(params, tx, masks, sparse=True)):
    state = lazy_state(opt)
    after = (bank_leaf(p["bank"]), bank_leaf(state.mu), bank_leaf(state.nu), bank_leaf(state.count))
    unread = ~masks[i]
    for old, new in zip(before, after):
      assert old[unread].tobytes() == new[unread].tobytes(), i
    np.testing.assert_array_equal(after[3] - before[3], masks[i])
    if i > 0:  # update 1 has LR 0
      assert np.all(np.any(after[0][masks[i]] != before[0][masks[i]], axis=(1, 2))), i
    for a, b in zip(jax.tree.leaves((p, opt)), jax.tree.leaves(masked[i])):  # the norms sum in other orders
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    before = after


def test_chapters_read_marks_routed_shared_and_never_padded_chapters():
  """Two memory layers on bank 0 and one on bank 1; 1 shared chapter; 6 chapters padded to 8."""
  load = jnp.asarray([[0, 2, 0, 0, 1, 0], [0, 0, 3, 0, 0, 0], [0, 0, 0, 0, 0, 5]], jnp.float32)
  got = np.asarray(optim.chapters_read(load, (0, 0, 1), 1, 8))
  want = np.array([[1, 1, 1, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0]], bool)
  np.testing.assert_array_equal(got, want)


def test_config_refuses_lazy_adam_with_a_frozen_bank_or_without_memory():
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.bank_optimizer: .*freeze_bank"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "lazy_adam", "train.freeze_bank": True})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.bank_optimizer: .*no bank"):
    moc_jax.load_config("configs/vanilla.py:tiny", {"train.bank_optimizer": "lazy_adam"})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.bank_optimizer: unknown value"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "sparse"})


# --- the real jitted train step ------------------------------------------------------------------------------

# `sequence` routing: one decision per row, so `probe` reads the chapters named off aux["chapters"] [layers, B, S]
STEP = {"model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2, "train.grad_accum": 2,
        "train.warmup_steps": 1, "memory.sharing": "per_layer", "train.bank_optimizer": "lazy_adam",
        "memory.routing": "sequence"}
STEPS = 3



def probe(graphdef, config, params, rows):
  """(chapters whose bank gradient is nonzero, chapters some decision named), bool [banks, chapters], for
  one micro-batch `rows`: the names come from the routing decisions (`aux["chapters"]`), not from `load`."""
  def loss(p):
    value, (_, aux) = lm_loss(nnx.merge(graphdef, p), rows, train=True)
    return value, aux["chapters"]
  grads, chapters = jax.grad(loss, has_aux=True)(params)
  g = grads["bank"]["memory"][...]
  layers = jnp.asarray(bank_ids(config))[:, None, None]
  named = jnp.zeros(g.shape[:2], bool).at[layers, chapters].set(True)
  return jnp.any(g != 0, axis=(2, 3)), named


class Trained(NamedTuple):
  config: object
  layout: state_lib.StateLayout
  init_bank: np.ndarray
  state: dict
  named: np.ndarray        # [STEPS, banks, chapters]: chapters some decision of the update named
  grad_support: np.ndarray  # after training, on a fresh micro-batch: chapters with a nonzero bank gradient
  grad_named: np.ndarray    # ... and the chapters that micro-batch's decisions named


@pytest.fixture(scope="module")
def trained():
  config = moc_jax.load_config("configs/moc.py:tiny", STEP)
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    init_bank = bank_leaf(state["params"]["bank"])
    data_sharding = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data_sharding)
    look = jax.jit(functools.partial(probe, layout.graphdef, config))
    bs, named = config.train.batch_size, []
    for s in range(STEPS):
      rows = tu.random_batch(config, s)
      micro = [jax.tree.map(lambda x: x[i * bs:(i + 1) * bs], rows) for i in range(config.train.grad_accum)]
      named.append(np.any([np.asarray(look(state["params"], mb)[1]) for mb in micro], axis=0))
      state, _ = step(state, jax.device_put(rows, data_sharding))
    support, last_named = look(state["params"], jax.tree.map(lambda x: x[:bs], tu.random_batch(config, 99)))
  return Trained(config, layout, init_bank, state, np.stack(named), np.asarray(support), np.asarray(last_named))


def test_train_step_moves_only_the_chapters_its_decisions_read(trained):
  """Two banks (per-layer sharing), two micro-batches per update: counts = the updates whose decisions
  named the chapter (shared chapter included); never-named chapters keep their initial value and zero
  moments; chapters named from update 2 on (LR > 0) moved."""
  state = lazy_state(trained.state["opt_state"])
  counts = bank_leaf(state.count)
  np.testing.assert_array_equal(counts, trained.named.sum(axis=0))
  assert np.all(counts[:, 0] == STEPS)  # the shared chapter
  unread = counts == 0
  assert unread.any() and (~unread).any()
  bank = bank_leaf(trained.state["params"]["bank"])
  assert bank[unread].tobytes() == trained.init_bank[unread].tobytes()
  assert not np.any(bank_leaf(state.mu)[unread]) and not np.any(bank_leaf(state.nu)[unread])
  late = trained.named[1:].any(axis=0)
  assert np.all(np.any(bank[late] != trained.init_bank[late], axis=(1, 2)))


def test_the_bank_gradient_is_zero_outside_the_chapters_read(trained):
  """The mask covers the gradient: no chapter a decision did not name has a nonzero bank gradient (so
  lazy Adam drops no gradient), and the check is not vacuous."""
  assert trained.grad_support.any()
  assert not np.any(trained.grad_support & ~trained.grad_named)


def test_a_skipped_nonfinite_update_leaves_counts_and_moments_unchanged(trained, monkeypatch):
  real = step_lib.lm_loss
  monkeypatch.setattr(step_lib, "lm_loss", lambda m, b, *, train, **kw: (lambda out: (jnp.nan * out[0], out[1]))(
      real(m, b, train=train, **kw)))
  config, layout = trained.config, trained.layout
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    before = jax.tree.map(np.asarray, {k: trained.state[k] for k in ("params", "opt_state")})
    state = jax.tree.map(jnp.copy, trained.state)
    data_sharding = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data_sharding)
    state, metrics = step(state, jax.device_put(tu.random_batch(config, 0), data_sharding))
  assert int(metrics["nonfinite"]) == 1
  assert_same_bytes({k: state[k] for k in ("params", "opt_state")}, before)


def test_checkpoint_round_trip_keeps_the_chapter_counts(trained, tmp_path):
  ck = ckpt_lib.Checkpointer(str(tmp_path), padding=trained.layout.padding)
  try:
    ck.save(STEPS, trained.state)
    ck.wait()
    got = ck.restore(STEPS, trained.layout.abstract)
  finally:
    ck.close()
  assert_same_bytes(got["opt_state"], trained.state["opt_state"])
  np.testing.assert_array_equal(bank_leaf(lazy_state(got["opt_state"]).count), trained.named.sum(axis=0))


# --- a chapter-sharded bank on 4 fake devices (a fresh process) ------------------------------------------

# Routed per sequence (tiny's prefix routing decides at every position and reads every chapter in one update), so
# that three updates leave chapters unread and their counts at zero.
SHARDED = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 4,
           "train.warmup_steps": 1, "memory.top_k": 4, "memory.routing": "sequence",
           "train.bank_optimizer": "lazy_adam"}
MESHES = {"memory4": ({"mesh.data": 1, "mesh.memory": 4}, None),
          "one_device": ({"mesh.data": 1, "num_fake_devices": 1}, 1)}


def sharded_run(name):
  """Three lazy-Adam updates on mesh `name` -> (user-view params and optimizer state, facts about the layout)."""
  overrides, devices = MESHES[name]
  config = moc_jax.load_config("configs/moc.py:tiny", {**SHARDED, **overrides})
  mesh = sharding.make_mesh(config, jax.devices()[:devices])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    data_sharding = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data_sharding)
    for s in range(STEPS):
      state, _ = step(state, jax.device_put(tu.random_batch(config, s), data_sharding))
    lazy = lazy_state(state["opt_state"])
    real = config.memory.num_chapters
    padded = [bank_leaf(t)[:, real:] for t in (state["params"]["bank"], lazy.mu, lazy.nu, lazy.count)]
    count = jax.tree.leaves(lazy.count)[0]
    facts = {"padded_chapters": layout.padding.padded, "pad_never_moved": not any(np.any(x) for x in padded),
             "count_shard": list(count.sharding.shard_shape(count.shape))}
    view = sharding.unpad_tree({k: state[k] for k in ("params", "opt_state")}, layout.padding)
  return jax.tree.map(np.asarray, view), facts


def sharded_worker():
  """Prints one JSON line: the sharded run's layout facts and its differences from one device."""
  sharded, facts = sharded_run("memory4")
  single, _ = sharded_run("one_device")
  lazy, ref = lazy_state(sharded["opt_state"]), lazy_state(single["opt_state"])
  diff = float(np.max(np.abs(bank_leaf(sharded["params"]["bank"]) - bank_leaf(single["params"]["bank"]))))
  print(json.dumps({**facts, "counts_equal": bool(np.array_equal(bank_leaf(lazy.count), bank_leaf(ref.count))),
                    "user_count_shape": list(bank_leaf(lazy.count).shape), "bank_max_abs_diff": diff,
                    "chapters_read": int(np.sum(bank_leaf(lazy.count) > 0))}), flush=True)


@pytest.mark.slow
def test_a_chapter_sharded_bank_never_moves_its_padded_chapters():
  """65 chapters on 4 chapter shards (68 stored): after three updates the 3 padded chapters, their moments
  and counts are still zero, the counts shard with the chapters, and the user view equals one device's."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  code = "from tests.train.test_lazy_adam import sharded_worker; sharded_worker()"
  (row,) = run_json(["-c", code], env={"XLA_FLAGS": flags})
  assert row["padded_chapters"] == 68 and row["pad_never_moved"], row
  assert row["count_shard"] == [1, 17] and row["user_count_shape"] == [1, 65], row
  assert row["counts_equal"] and 0 < row["chapters_read"] < 65, row
  # Adam divides by sqrt(v): rounding differences of near-zero gradients across meshes show as a small
  # fraction of the LR (3e-3)
  assert row["bank_max_abs_diff"] <= 5e-5, row
