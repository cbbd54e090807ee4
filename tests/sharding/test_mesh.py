"""The mesh: config validation, chapter padding, and (in 8-fake-device subprocesses) equivalence of
loss and gradients across meshes, cross-mesh checkpoint restore and the compile report."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax.config import bank_shape
from moc_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "sharding", "mesh_worker.py")


def run_json(args, timeout=900, env=None):
  """Runs a python command in a fresh process (its own device count); returns its JSON stdout lines."""
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env or {})}
  proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def fake8(**overrides):
  return moc_jax.load_config("configs/moc.py:tiny", {"num_fake_devices": 8, "train.batch_size": 16, **overrides})


# --- validation (in process: num_fake_devices stands for the device count) --------------------------

@pytest.mark.parametrize("overrides, field", [
    ({"mesh.data": 3}, "config.mesh"),                                    # 3 does not divide 8 devices
    ({"mesh.data": -1, "mesh.memory": -1}, "config.mesh"),                # two fills
    ({"mesh.data": 2, "mesh.memory": 2}, "config.mesh"),                  # 4 != 8 devices
    ({"mesh.data": 0}, "config.mesh.data"),
    ({"mesh.data": 1, "mesh.tensor": 8}, "config.model.vocab_size"),      # 260 rows on 8 tensor shards
    ({"mesh.data": 1, "mesh.tensor": 8, "model.vocab_size": 256}, "config.model.num_heads"),  # 4 heads
    ({"mesh.data": 1, "mesh.fsdp": 8, "train.batch_size": 12}, "config.train.batch_size"),
    ({"logical_axis_rules": (("batch", "data"), ("chapters", "memory")), "mesh.data": 2, "mesh.memory": 4},
     "config.logical_axis_rules"),                                        # memory shards chapters, not batch
    ({"logical_axis_rules": (("batch", "pipeline"),)}, "config.logical_axis_rules"),
])
def test_validate_rejects_meshes_that_do_not_fit(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    fake8(**overrides)


def test_chapters_are_padded_to_the_shard_count_and_counts_do_not_show_it():
  one = moc_jax.count_params(moc_jax.load_config("configs/moc.py:tiny"))
  for memory, padded in ((8, 72), (4, 68), (1, 65)):
    cfg = fake8(**{"mesh.data": 8 // memory, "mesh.memory": memory})
    assert sharding.padded_chapters(cfg, bank_shape(cfg)) == padded
    bank = moc_jax.abstract_model(cfg).bank.memory
    assert bank.shape == (1, padded, 16, 64)
    assert moc_jax.count_params(cfg) == one


def test_padded_chapters_are_zero_and_identical_to_the_unpadded_init():
  cfg = fake8(**{"mesh.data": 1, "mesh.memory": 8})
  padded = moc_jax.build_model(cfg, seed=3).bank.memory[...]
  plain = moc_jax.build_model(moc_jax.load_config("configs/moc.py:tiny"), seed=3).bank.memory[...]
  np.testing.assert_array_equal(np.asarray(padded[:, :65]), np.asarray(plain))
  assert not np.any(np.asarray(padded[:, 65:]))


def test_user_view_round_trip_drops_and_restores_padding():
  mesh = sharding.make_mesh(moc_jax.load_config("configs/moc.py:tiny"), jax.devices()[:1])
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  rng = np.random.default_rng(0)
  bank = np.concatenate([rng.normal(size=(2, 65, 3, 4)), np.zeros((2, 7, 3, 4))], axis=1).astype(np.float32)
  tree = {"params": {"bank": {"memory": jax.device_put(bank, rep)}, "w": jax.device_put(np.ones(3, np.float32), rep)}}
  pad = sharding.ChapterPadding(65, 72)
  view = sharding.unpad_tree(tree, pad)
  assert view["params"]["bank"]["memory"].shape == (2, 65, 3, 4)
  back = sharding.pad_tree(view, pad, jax.tree.map(lambda x: x.sharding, tree))
  np.testing.assert_array_equal(np.asarray(back["params"]["bank"]["memory"]), bank)
  np.testing.assert_array_equal(np.asarray(back["params"]["w"]), np.ones(3))


# --- 8 fake devices, each in a fresh process ---------------------------------------------------------

# by default the meshes that combine axes (tensor with memory and fsdp; the scatter and ring reads of the bank)
@pytest.mark.parametrize("meshes", [
    pytest.param(("data8", "fsdp8", "memory8", "data2_memory4", "data4_tensor2"), marks=pytest.mark.slow),
    ("memory2_fsdp2_tensor2", "memory8_scatter", "data2_memory4_ring")])
def test_meshes_give_the_single_device_loss_and_gradients(meshes):
  rows = run_json([WORKER, "equivalence", *meshes])
  assert tuple(r["mesh"] for r in rows) == meshes
  for r in rows:
    assert r["params_equal"], r  # same init on every mesh (padding aside)
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * abs(r["ref_loss"]), r
    assert r["worst_grad_rel_err"] <= 1e-5, r
  by = {r["mesh"]: r for r in rows}
  if "memory8" in by:
    assert by["memory8"]["bank_shard"] == [1, 9, 16, 64] and by["memory8"]["padded_chapters"] == 72
    assert by["data2_memory4"]["bank_shard"] == [1, 17, 16, 64]


@pytest.mark.slow
def test_per_position_routing_on_a_sharded_bank_gives_the_single_device_loss_and_gradients():
  """Expert parallelism over chapters: joint reads merged by log-sum-exp (prefix), per-slot reads
  summed (token), each against one device with the same routing."""
  meshes = ("memory8@prefix", "data2_memory4@token")
  rows = run_json([WORKER, "equivalence", *meshes])
  assert tuple(r["mesh"] for r in rows) == meshes
  for r in rows:
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * abs(r["ref_loss"]), r
    assert r["worst_grad_rel_err"] <= 1e-5, r


@pytest.mark.slow
def test_checkpoint_saved_on_one_mesh_restores_on_others_and_one_device(tmp_path):
  rows = run_json([WORKER, "restore", str(tmp_path / "ck")])
  assert [r["mesh"] for r in rows] == ["memory8", "fsdp8", "memory2_fsdp2_tensor2", "one_device"]
  for r in rows:  # params and Adam moments bit-identical, padding zero, counters restored
    assert r["max_abs_diff"] == 0.0 and r["pad_is_zero"] and r["step"] == 2, r
  assert rows[0]["shard"] == [1, 9, 16, 64] and rows[-1]["shard"] == [1, 65, 16, 64]


def test_compile_mode_reports_a_sharded_bank_and_no_whole_bank_gather():
  """`sequence` routing, whose reads bring a row's chapters from their shards: no all-gather comes near the bank
  (per-position routing all-gathers the queries instead, [B, L, H, dh], larger than tiny's bank)."""
  rows = run_json(["-m", "moc_jax.main", "--config=configs/moc.py:tiny", "--mode=compile",
                   "--config.num_fake_devices=8", "--config.mesh.data=2", "--config.mesh.memory=4",
                   "--config.memory.routing=sequence"])
  (r,) = rows
  assert r["devices"] == 8 and r["mesh"]["memory"] == 4
  assert r["bank"]["padded_shape"] == [1, 68, 16, 64] and r["bank"]["shard_shape"] == [1, 17, 16, 64]
  assert r["bank"]["shard_bytes"] == 17 * 16 * 64 * 4
  assert r["largest_all_gather"]["bytes"] < r["bank"]["full_copy_bytes"] / 2
  assert r["xla"]["temp"] > 0 and r["flops_per_device"] > 0
  assert r["params_bytes"] < moc_jax.count_params(moc_jax.load_config("configs/moc.py:tiny"))["total"] * 4
