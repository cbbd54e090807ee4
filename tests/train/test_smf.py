"""`train.bank_optimizer=smf`: sparse memory finetuning over chapters.

The TF-IDF choice against a numpy ranking on random counts, and its controls (`smf_rank` tf and random); the
background file's idf against its formula and its refusals; the read weights against a loop; through the real
jitted train step, chapters outside the top-t keep their bank values and optimizer state bit for bit, and with
`bank_rule=sgd` the top-t move by exactly -lr x their gradient; with top-t = every chapter, SMF is the dense update.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moc_jax
from moc_jax import bank_background, optim, sharding
from moc_jax import state as state_lib
from moc_jax.config import bank_ids
from moc_jax.model.routing import read_weight
from moc_jax.train import step as step_lib
from tests.train.test_lazy_adam import bank_leaf, lazy_state, run_updates, tiny_optimizer
from tests.train.train_utils import random_batch


def numpy_smf_mask(read, banks_of_layer, idf, top_t, padded):
  """Per bank: chapters sorted by score (descending; ties by lower id), the first top_t marked."""
  banks, c = idf.shape
  tf = np.zeros((banks, c))
  for layer, b in enumerate(banks_of_layer):
    tf[b] += read[layer]
  mask = np.zeros((banks, padded), bool)
  for b in range(banks):
    score = tf[b] * idf[b]
    order = sorted(range(c), key=lambda i: (-score[i], i))
    mask[b, order[:top_t]] = True
  return mask


def test_tf_idf_choice_equals_numpy_on_random_counts():
  rng = np.random.default_rng(0)
  for trial in range(20):
    layers, banks, c, top_t = 3, 2, 11, int(rng.integers(1, 12))
    read = rng.integers(0, 4, (layers, c)).astype(np.float32) * rng.random((layers, c)).astype(np.float32)
    read[:, rng.random(c) < 0.3] = 0  # unread chapters tie at score 0
    idf = rng.random((banks, c)).astype(np.float32) * 3
    got = np.asarray(optim.smf_chapters(jnp.asarray(read), (0, 1, 0), jnp.asarray(idf), top_t, 13))
    want = numpy_smf_mask(read.astype(np.float64), (0, 1, 0), idf.astype(np.float64), top_t, 13)
    np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
    assert not got[:, c:].any()  # padded chapters never


def test_the_controls_rank_by_tf_alone_or_draw_among_the_chapters_read():
  """tf: numpy's ranking with idf 1 (the shared chapter, read by everything, ranks first). random: t of the chapters
  read (all of them when fewer), the same draw for the same key, another for another key."""
  rng = np.random.default_rng(5)
  read = (rng.random((2, 20)) * (rng.random((2, 20)) < 0.5)).astype(np.float32)
  read[:, 0] = 5.0  # the shared chapter
  idf = rng.random((1, 20)).astype(np.float32)
  idf[0, 0] = 0.0
  tf = np.asarray(optim.smf_chapters(jnp.asarray(read), (0, 0), jnp.asarray(idf), 4, 22, "tf"))
  np.testing.assert_array_equal(tf, numpy_smf_mask(read.astype(np.float64), (0, 0), np.ones((1, 20)), 4, 22))
  assert tf[0, 0] and not np.asarray(optim.smf_chapters(jnp.asarray(read), (0, 0), jnp.asarray(idf), 4, 22))[0, 0]
  was_read = read.sum(0) > 0
  draws = [np.asarray(optim.smf_chapters(jnp.asarray(read), (0, 0), jnp.asarray(idf), 4, 22, "random",
                                         jax.random.key(k)))[0] for k in (0, 0, 1, 2, 3)]
  for d in draws:
    assert d.sum() == 4 and was_read[d[:20]].all() and not d[20:].any()
  assert (draws[0] == draws[1]).all() and any((d != draws[0]).any() for d in draws[2:])
  few = np.zeros((1, 20), np.float32)
  few[0, [3, 7]] = 1.0
  assert np.flatnonzero(np.asarray(optim.smf_chapters(jnp.asarray(few), (0,), jnp.asarray(idf), 2, 20, "random",
                                                      jax.random.key(9)))[0]).tolist() == [3, 7]


def test_sgd_moves_the_top_t_by_the_gradient_alone():
  """bank_rule=sgd through the real train step (two updates): chapters outside numpy's top-3 keep value and state
  bit for bit; the top-3 move by exactly -lr x gradient (the gradient of the same batch taken here, unclipped),
  with no moments, while the counts still count the updates."""
  from moc_jax.losses import lm_loss
  from flax import nnx
  c = 65
  idf = np.random.default_rng(2).random((2, c)).astype(np.float32)
  overrides = {"train.bank_optimizer": "smf", "train.smf_top_t": 3, "train.bank_rule": "sgd",
               "train.clip_norm": 0.0, "train.warmup_steps": 0, "train.schedule": "constant",
               "train.bank_lr": 0.5, "train.base_lr": 0.0, "train.memory_lr": 0.0}
  config, init, history = train(overrides, idf, 2)
  model = moc_jax.build_model(config)
  graphdef = nnx.graphdef(model)
  before, counts = init["params"], bank_leaf(lazy_state(init["opt_state"]).count)
  bank_grad = jax.jit(lambda p, b: jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), b, train=True)[0])(p)[
      "bank"]["memory"][...])
  for s, (state, metrics) in enumerate(history):
    mask = numpy_smf_mask(metrics["router_read"].astype(np.float64), bank_ids(config), idf.astype(np.float64), 3, c)
    batch = random_batch(config, s)
    micro = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), batch)
    grad = np.mean([np.asarray(bank_grad(before, jax.tree.map(lambda x, i=i: x[i], micro))) for i in range(2)],
                   axis=0)
    old, new = bank_leaf(before["bank"]), bank_leaf(state["params"]["bank"])
    assert old[~mask].tobytes() == new[~mask].tobytes()
    np.testing.assert_allclose(new[mask], old[mask] - 0.5 * grad[mask], rtol=1e-5, atol=1e-7)
    lazy = lazy_state(state["opt_state"])
    assert not bank_leaf(lazy.mu).any() and not bank_leaf(lazy.nu).any()
    np.testing.assert_array_equal(bank_leaf(lazy.count) - counts, mask)
    before, counts = state["params"], bank_leaf(lazy.count)


def test_idf_follows_its_formula_and_bad_files_are_refused(tmp_path):
  df = np.array([[40, 0, 3, 40], [40, 7, 1, 0]])
  path = str(tmp_path / "bg.json")
  bank_background.write(path, df, np.array([40, 40]), step=5)
  want = np.log((1 + 40) / (1 + df.astype(np.float64)))
  np.testing.assert_allclose(bank_background.idf(path, 2, 4), want, rtol=1e-6)
  assert bank_background.idf(path, 2, 4)[0, 0] == 0  # read by every decision: no weight
  with pytest.raises(moc_jax.ConfigError, match=r"train\.smf_background: .*2 banks x 4 chapters, the model has 1 x 4"):
    bank_background.idf(path, 1, 4)
  with pytest.raises(moc_jax.ConfigError, match=r"train\.smf_background: .*does not exist.*moc_jax\.eval\.background"):
    bank_background.idf(str(tmp_path / "missing.json"), 2, 4)
  (tmp_path / "bad.json").write_text(json.dumps({"df": [[50]], "decisions": [40]}))
  with pytest.raises(moc_jax.ConfigError, match="outside"):
    bank_background.idf(str(tmp_path / "bad.json"), 1, 1)


def test_read_weight_sums_chapter_weights_per_layer():
  rng = np.random.default_rng(1)
  chapters = rng.integers(0, 6, (2, 3, 5, 4))
  weights = rng.random((2, 3, 5, 4)).astype(np.float32)
  valid = rng.random((3, 5)) < 0.7
  want = np.zeros((2, 6))
  for layer, b, pos, slot in np.ndindex(chapters.shape):
    want[layer, chapters[layer, b, pos, slot]] += weights[layer, b, pos, slot] * valid[b, pos]
  got = read_weight(jnp.asarray(chapters), jnp.asarray(weights), 6, jnp.asarray(valid))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  counts = np.zeros((2, 6))  # no weights (FFN memory's columns): each read counts 1
  for layer, b, pos, slot in np.ndindex(chapters.shape):
    counts[layer, chapters[layer, b, pos, slot]] += valid[b, pos]
  np.testing.assert_array_equal(np.asarray(read_weight(jnp.asarray(chapters), None, 6, jnp.asarray(valid))), counts)


# --- the real jitted train step on the tiny model ----------------------------------------------------------

STEP = {"model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2, "train.grad_accum": 2,
        "train.warmup_steps": 1, "memory.sharing": "per_layer", "model.compute_dtype": "float32",
        "model.num_layers": 2, "memory.layer_indices": (0, 1), "model.remat": "none",
        "train.smf_background": "unused"}


def train(overrides, idf, steps):
  """(config, initial state, state and metrics after each update) of the tiny model."""
  config = moc_jax.load_config("configs/moc.py:tiny", {**STEP, **overrides})
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    init = jax.tree.map(np.asarray, {k: state[k] for k in ("params", "opt_state")})
    data_sharding = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data_sharding,
                                   None if idf is None else jnp.asarray(idf))
    history = []
    for s in range(steps):
      state, metrics = step(state, jax.device_put(random_batch(config, s), data_sharding))
      history.append(jax.tree.map(np.asarray, ({k: state[k] for k in ("params", "opt_state")}, metrics)))
  return config, init, history


# FFN memory: 332 columns on a 4-ary tree of 2 levels (43 a level-0 node, 10 a leaf), each read whole (weight 1)
FFN = {"memory.kind": "ffn", "memory.routing": "cluster", "data.cluster.k": 4, "memory.num_shared": 0,
       "memory.cluster_chapters": (43, 10), "memory.num_chapters": 332}


@pytest.mark.parametrize("memory", [{}, pytest.param(FFN, marks=pytest.mark.slow)], ids=["chapters", "ffn"])
def test_chapters_outside_the_top_t_keep_bank_and_optimizer_state_bit_identical(memory):
  """Two banks, two micro-batches per update, top-3 of the chapters (65; FFN memory's 332 columns) by tf·idf with a
  random idf: per update, the chapters numpy ranks outside the top-3 (from the step's own read weights) keep
  value, moments and count bit for bit; the top-3 move (from update 2, once the LR is nonzero)."""
  c = memory.get("memory.num_chapters", 65)
  idf = np.random.default_rng(2).random((2, c)).astype(np.float32)
  config, init, history = train({"train.bank_optimizer": "smf", "train.smf_top_t": 3, **memory}, idf, 3)
  before = (bank_leaf(init["params"]["bank"]), *(bank_leaf(x) for x in lazy_state(init["opt_state"])[1:]),
            bank_leaf(lazy_state(init["opt_state"]).count))
  for i, (state, metrics) in enumerate(history):
    mask = numpy_smf_mask(metrics["router_read"].astype(np.float64), bank_ids(config), idf.astype(np.float64), 3, c)
    lazy = lazy_state(state["opt_state"])
    after = (bank_leaf(state["params"]["bank"]), bank_leaf(lazy.mu), bank_leaf(lazy.nu), bank_leaf(lazy.count))
    for old, new in zip(before, after):
      assert old[~mask].tobytes() == new[~mask].tobytes(), i
    np.testing.assert_array_equal(after[3] - before[3], mask)
    if i > 0:
      assert np.all(np.any(after[0][mask] != before[0][mask], axis=(1, 2))), i
    before = after
  assert metrics["router_read"].sum() > 0
  if memory:  # every real position reads its path's 43 + 10 columns once, in each memory layer: 4 rows, 2 with 5 pads
    np.testing.assert_array_equal(metrics["router_read"].sum(axis=1), [(4 * 32 - 2 * 5) * 53] * 2)


@pytest.mark.default_backend
def test_smf_with_every_chapter_is_the_dense_update():
  """top-t = every chapter: whatever the reads and the background, the mask is all chapters and three updates
  equal dense AdamW (every parameter, the bank's moments) to float32 rounding."""
  params, dense_tx = tiny_optimizer()
  _, smf_tx = tiny_optimizer(**{"train.bank_optimizer": "smf", "train.smf_top_t": 65, "train.init_from": "x"})
  rng = np.random.default_rng(3)
  masks = [np.asarray(optim.smf_chapters(jnp.asarray(rng.random((2, 65)) * (rng.random((2, 65)) < 0.2), jnp.float32),
                                         (0, 0), jnp.asarray(rng.random((1, 65)), jnp.float32), 65, 65))
           for _ in range(3)]
  assert all(m.all() for m in masks)
  dense, dense_opt = run_updates(params, dense_tx, [None] * 3)[-1]
  smf, smf_opt = run_updates(params, smf_tx, masks)[-1]
  for a, b in zip(jax.tree.leaves(smf), jax.tree.leaves(dense)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
  adam = dense_opt[-1].inner_states["bank"].inner_state[0]
  np.testing.assert_allclose(bank_leaf(lazy_state(smf_opt).mu), bank_leaf(adam.mu), rtol=1e-6, atol=1e-12)
  np.testing.assert_allclose(bank_leaf(lazy_state(smf_opt).nu), bank_leaf(adam.nu), rtol=1e-6, atol=1e-12)


def test_config_refuses_smf_without_background_or_with_a_bad_top_t():
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.smf_background: .*moc_jax\.eval\.background"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "smf"})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.smf_top_t: 66 is outside \[1, memory\.num_chapters=65\]"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "smf", "train.smf_top_t": 66,
                                                "train.init_from": "runs/x"})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.bank_optimizer: 'smf' with train\.freeze_bank"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_optimizer": "smf", "train.freeze_bank": True})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.bank_rule: 'sgd' with train\.bank_optimizer='dense'"):
    moc_jax.load_config("configs/moc.py:tiny", {"train.bank_rule": "sgd"})
  with pytest.raises(moc_jax.ConfigError, match=r"config\.train\.smf_rank: "):
    moc_jax.load_config("configs/moc.py:tiny", {"train.smf_rank": "idf"})


def test_background_counts_per_bank_sum_the_layers_reading_it():
  """Three memory layers, the first and last on bank 0; 10 decisions per layer; 1 shared chapter."""
  counts = np.array([[0, 4, 0, 6], [0, 1, 9, 0], [0, 2, 2, 2]])
  got = bank_background.per_bank(counts, 10, (0, 1, 0), 1)
  np.testing.assert_array_equal(got["decisions"], [20, 10])
  np.testing.assert_array_equal(got["df"], [[20, 6, 2, 8], [10, 1, 9, 0]])


def test_training_refuses_a_missing_background_before_touching_the_workdir(tmp_path):
  """Exit code 2, one line naming train.smf_background and the command that writes it; no config.json."""
  import subprocess
  import sys
  workdir = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "moc_jax.main", "--config=configs/moc.py:tiny,runlocal",
                         f"--workdir={workdir}", "--config.train.bank_optimizer=smf",
                         f"--config.train.init_from={tmp_path / 'pretrained'}"], capture_output=True, text=True)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "train.smf_background" in proc.stderr and "moc_jax.eval.background" in proc.stderr
  assert not (workdir / "config.json").exists()
