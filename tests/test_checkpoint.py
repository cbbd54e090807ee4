"""Checkpoints (moc_jax/checkpoint.py): where they live, a bit-identical round trip of the whole train state
and the data iterator, which step counts as the newest, the user view of a padded bank on disk, and the
CheckpointErrors a user meets (weights-only checkpoints resumed, missing directories, another model).

The state has the layout of the tiny MoC model's train state (two layers, one memory layer) on a one-device
mesh, filled with seeded random data: every leaf differs from its initial value, so a restore that fell back
to an initialisation could not pass.
"""
import contextlib
import os
import re
import shutil
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import moc_jax
from moc_jax import checkpoint as ckpt_lib
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.data import make_train_iterator
from moc_jax.errors import CheckpointError, CorruptCheckpointError
from tests.asserts import assert_same_bytes
from tests.train import train_utils as tu

SMALL = {"model.num_layers": 2, "memory.layer_indices": (1,), "model.remat": "none"}
SAVED = ("params", "opt_state", "rng", "step", "skipped")  # what a restore gives back


class Run(NamedTuple):
  config: object
  mesh: object
  layout: state_lib.StateLayout
  state: dict


def tiny_config(data_dir, spec="configs/moc.py:tiny", **extra):
  return moc_jax.load_config(spec, tu.overrides(data_dir, **{**SMALL, **extra}))


def scrambled(tree, seed):
  """Arrays of seeded random values with the shapes, dtypes and shardings of `tree`'s leaves."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    if np.issubdtype(x.dtype, np.floating):
      v = rng.standard_normal(x.shape)
    else:
      v = rng.integers(1, 2**31 - 1, x.shape)
    return jax.device_put(v.astype(x.dtype), x.sharding)

  return jax.tree.map(leaf, tree)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def run(data_dir):
  config = tiny_config(data_dir)
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  layout = state_lib.build_state(config, mesh)
  return Run(config, mesh, layout, scrambled(layout.abstract, seed=0))


@pytest.fixture(scope="module")
def saved_workdir(run, tmp_path_factory):
  """A workdir whose checkpoints/ holds the scrambled state as step 3."""
  workdir = tmp_path_factory.mktemp("saved")
  save(workdir / "checkpoints", run.state, 3)
  return workdir


@contextlib.contextmanager
def opened(directory, **kwargs):
  ck = ckpt_lib.Checkpointer(str(directory), **kwargs)
  try:
    yield ck
  finally:
    ck.close()


def save(directory, state, *steps, data_iter=None, **kwargs):
  with opened(directory, **kwargs) as ck:
    for step in steps:
      ck.save(step, state, data_iter)


def train_iterator(config):
  return make_train_iterator(state_lib.micro_batch_config(config))


# --- checkpoint_dir --------------------------------------------------------------------------------------

def test_checkpoint_dir_accepts_a_workdir_or_its_checkpoints_dir(tmp_path, monkeypatch):
  """A workdir with checkpoints/ resolves to it; that directory itself, or a directory without one,
  resolves to itself; relative paths come back absolute."""
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  (tmp_path / "bare").mkdir()
  want = str(tmp_path / "run" / "checkpoints")
  assert ckpt_lib.checkpoint_dir(str(tmp_path / "run")) == want
  assert ckpt_lib.checkpoint_dir(want) == want
  assert ckpt_lib.checkpoint_dir(str(tmp_path / "bare")) == str(tmp_path / "bare")
  monkeypatch.chdir(tmp_path)
  assert ckpt_lib.checkpoint_dir("run") == want
  assert ckpt_lib.checkpoint_dir(os.path.join("run", "checkpoints")) == want


# --- save / restore ----------------------------------------------------------------------------------------

def test_round_trip_restores_state_and_data_position_bit_identically(run, tmp_path):
  """Params, Adam state, rng and counters come back with the same bytes and the abstract state's
  shardings; a fresh iterator restored from the checkpoint yields the batch the saved one would have
  yielded next (which is not the stream's first batch)."""
  it = train_iterator(run.config)
  first = next(it)
  next(it)
  save(tmp_path, run.state, 7, data_iter=it)
  want_next = next(it)
  fresh = train_iterator(run.config)
  with opened(tmp_path) as ck:
    got = ck.restore(7, run.layout.abstract, fresh)
  assert_same_bytes(got, {k: run.state[k] for k in SAVED})
  for leaf, abstract in zip(jax.tree.leaves(got), jax.tree.leaves({k: run.layout.abstract[k] for k in SAVED})):
    assert leaf.sharding == abstract.sharding
  assert_same_bytes(next(fresh), want_next)
  assert first["input_ids"].tobytes() != want_next["input_ids"].tobytes()


def test_a_data_state_of_an_earlier_pipeline_is_refused_and_the_step_kept(run, tmp_path):
  """A step whose iterator state an earlier input pipeline wrote (no layout tag) is the data's DataError, raised as
  it is: not read as corruption, so the step is not set aside and nothing in the directory changes."""
  import glob
  import json

  from moc_jax.errors import DataError
  save(tmp_path, run.state, 7, data_iter=train_iterator(run.config))
  (state_file,) = glob.glob(str(tmp_path / "7" / "data_iter" / "*.json"))
  with open(state_file, "w") as f:
    json.dump({"parent": {"parent": {"next_index": 5}, "next_index_in_buffer": 0}, "next_row": 3, "counter": 3}, f)
  before = sorted(os.listdir(tmp_path))
  with opened(tmp_path) as ck, pytest.raises(DataError, match="another layout"):
    ck.restore(7, run.layout.abstract, train_iterator(run.config))
  assert sorted(os.listdir(tmp_path)) == before


def test_latest_step_is_the_newest_saved_step(run, tmp_path):
  """None before any save; after saving steps 1, 2 and 4, step 4 — in the saving process and in a new one
  (a resumed run), which reads the steps from the directory."""
  with opened(tmp_path) as ck:
    assert ck.latest_step() is None
    for step in (1, 2, 4):
      ck.save(step, run.state)
    ck.wait()
    assert ck.latest_step() == 4
  with opened(tmp_path) as ck:
    assert ck.latest_step() == 4


@pytest.mark.parametrize("leftover", ["9.orbax-checkpoint-tmp", "9.orbax-checkpoint-tmp-1712345678"])
def test_an_interrupted_save_is_not_the_latest_step(run, tmp_path, leftover):
  """A save killed before it finished leaves its step's temporary directory (named as the installed Orbax
  names a step in flight; older Orbax versions add a timestamp), holding the items but no commit marker.
  It must be ignored: the newest finished step, 2, is what a restart and `restore_params` see."""
  directory = tmp_path / "checkpoints"
  save(directory, run.state, 1, 2)
  shutil.copytree(directory / "2", directory / leftover)
  (directory / leftover / "commit_success.txt").unlink(missing_ok=True)
  with opened(directory) as ck:
    assert ck.latest_step() == 2
  params, step = ckpt_lib.restore_params(str(tmp_path), run.layout.abstract["params"])
  assert step == 2
  assert_same_bytes(params, run.state["params"])


def test_a_padded_bank_is_saved_as_the_user_view(tmp_path):
  """With chapters padded 5 -> 8, the checkpoint holds exactly the 5 real chapters of the bank and of its
  Adam moment (restored without padding they equal the saved arrays cut by hand), and restoring with the
  padding gives back the padded state, zero chapters included."""
  mesh = sharding.make_mesh(moc_jax.config.base_config(), jax.devices()[:1])
  put = lambda x, spec=jax.P(): jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  rng = np.random.default_rng(1)
  bank = np.concatenate([rng.standard_normal((1, 5, 2, 3)), np.zeros((1, 3, 2, 3))], axis=1).astype(np.float32)
  w = rng.standard_normal(4).astype(np.float32)
  state = {"params": {"bank": {"memory": put(bank, jax.P(None, "memory"))}, "w": put(w)},
           "opt_state": {"mu": {"bank": {"memory": put(2 * bank, jax.P(None, "memory"))}}},
           "rng": put(np.array([5, 6], np.uint32)), "step": put(np.int32(3)), "skipped": put(np.int32(1))}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  pad = sharding.ChapterPadding(5, 8)
  save(tmp_path, state, 3, padding=pad)

  user_bank = jax.ShapeDtypeStruct((1, 5, 2, 3), np.float32, sharding=state["params"]["w"].sharding)
  user_params = {"bank": {"memory": user_bank}, "w": abstract["params"]["w"]}
  on_disk, _ = ckpt_lib.restore_params(str(tmp_path), user_params)
  assert_same_bytes(on_disk, {"bank": {"memory": bank[:, :5]}, "w": w})
  with opened(tmp_path, padding=pad) as ck:
    assert_same_bytes(ck.restore(3, abstract), state)
  repadded, _ = ckpt_lib.restore_params(str(tmp_path), abstract["params"], padding=pad)
  assert_same_bytes(repadded, state["params"])


# --- errors ------------------------------------------------------------------------------------------------

def test_a_weights_only_checkpoint_cannot_be_resumed_but_restores_params(run, tmp_path):
  """A checkpoint holding only `params` (as the MoC-PT importer writes it) is refused for resumption with a
  message naming the missing items and --config.train.init_from; `restore_params` still reads it."""
  directory = tmp_path / "checkpoints"
  manager = ocp.CheckpointManager(str(directory), item_names=ckpt_lib.ITEMS,
                                  options=ocp.CheckpointManagerOptions(create=True))
  manager.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(run.state["params"])))
  manager.wait_until_finished()
  manager.close()
  with opened(directory) as ck:
    with pytest.raises(CheckpointError, match=r"step 5 has no opt_state, step, rng .*train\.init_from"):
      ck.restore(5, run.layout.abstract)
  params, step = ckpt_lib.restore_params(str(tmp_path), run.layout.abstract["params"])
  assert step == 5
  assert_same_bytes(params, run.state["params"])


@pytest.mark.parametrize("make", ["missing", "empty_workdir"])
def test_restore_params_without_a_checkpoint_names_the_directory(run, tmp_path, make):
  """A path that does not exist, or a workdir whose checkpoints/ is empty, is named in the error."""
  target = tmp_path / "run"
  searched = target
  if make == "empty_workdir":
    (target / "checkpoints").mkdir(parents=True)
    searched = target / "checkpoints"
  with pytest.raises(CheckpointError, match=f"no checkpoint found under {re.escape(str(searched))};"):
    ckpt_lib.restore_params(str(target), run.layout.abstract["params"])


@pytest.mark.parametrize("spec, overrides", [
    ("configs/moc.py:tiny", {"model.d_model": 32}),                  # every shape changes
    ("configs/moc.py:tiny", {"memory.num_chapters": 33, "memory.num_tokens": 33 * 16}),  # the bank's shape
    ("configs/vanilla.py:tiny", {}),                                 # no bank: another tree
])
def test_restore_params_onto_another_model_config_raises(run, data_dir, saved_workdir, spec, overrides):
  """Shapes or a tree that differ from the saved params give a CheckpointError (not a corrupt one) naming the
  step and the first arrays that differ, found from the step's manifest before any array is read."""
  other = tiny_config(data_dir, spec, **overrides)
  abstract = state_lib.build_state(other, run.mesh).abstract["params"]
  with pytest.raises(CheckpointError) as info:
    ckpt_lib.restore_params(str(saved_workdir), abstract)
  assert not isinstance(info.value, CorruptCheckpointError)
  pattern = f"checkpoint {re.escape(str(saved_workdir / 'checkpoints' / '3'))} does not match this config \\(\\d+ arrays differ: params"
  assert re.search(pattern, str(info.value)), str(info.value)


def test_restore_params_onto_the_same_config_reads_the_saved_params(run, saved_workdir):
  """The counterpart of the mismatch cases: the same checkpoint restores onto its own config."""
  params, step = ckpt_lib.restore_params(str(saved_workdir), run.layout.abstract["params"])
  assert step == 3
  assert_same_bytes(params, run.state["params"])


def test_restoring_a_step_that_was_never_saved_names_the_saved_steps(run, saved_workdir):
  with opened(saved_workdir / "checkpoints") as ck:
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 9 under .*; saved steps: \[3\]"):
      ck.restore(9, run.layout.abstract)


def test_restore_params_of_a_missing_directory_creates_nothing(run, tmp_path):
  with pytest.raises(CheckpointError, match="no checkpoint found"):
    ckpt_lib.restore_params(str(tmp_path / "nowhere"), run.layout.abstract["params"])
  assert not (tmp_path / "nowhere").exists()


# --- corruption ------------------------------------------------------------------------------------------

def test_the_fingerprint_changes_with_any_one_element(run):
  """One element of a leaf nudged by one ulp, or two elements swapped, changes that leaf's fingerprint and no
  other's; the same arrays give the same manifest."""
  params = run.state["params"]
  leaves, treedef = jax.tree.flatten(params)
  nudged, swapped = np.array(leaves[0]), np.array(leaves[0])
  nudged.flat[5] = np.nextafter(nudged.flat[5], np.inf)
  swapped.flat[[0, 1]] = swapped.flat[[1, 0]]
  want = ckpt_lib.manifest({"params": params})["params"]
  assert ckpt_lib.manifest({"params": params})["params"] == want
  for changed in (nudged, swapped):
    got = ckpt_lib.manifest({"params": jax.tree.unflatten(treedef, [changed, *leaves[1:]])})["params"]
    assert [p for p in want if want[p] != got[p]] == [next(iter(want))]


def _damaged_copy(saved_workdir, tmp_path, damage):
  workdir = tmp_path / "run"
  shutil.copytree(saved_workdir, workdir)
  damage(workdir / "checkpoints" / "3")
  return workdir


@pytest.mark.parametrize("damage, error", [
    (lambda d: shutil.rmtree(d / "opt_state"), "items opt_state were saved but are missing"),
    (lambda d: (d / "_CHECKPOINT_METADATA").write_text("{"), "step metadata cannot be read"),
])
def test_a_step_missing_what_it_saved_is_corrupt(run, saved_workdir, tmp_path, damage, error):
  """A saved item whose directory is gone, or unreadable step metadata, is corruption (not a weights-only
  checkpoint, not another config); nothing is renamed by a restore."""
  workdir = _damaged_copy(saved_workdir, tmp_path, damage)
  with opened(workdir / "checkpoints") as ck:
    with pytest.raises(CorruptCheckpointError, match=error):
      ck.restore(3, run.layout.abstract)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]


def test_evaluation_names_a_corrupt_step_and_the_steps_that_restore_and_renames_nothing(run, tmp_path):
  """The newest step's parameters altered on disk (same shapes: it decodes): eval/generate's restore names it
  and the steps that restore, with the --step to pass; the run's directory is left as it was."""
  directory = tmp_path / "checkpoints"
  save(directory, run.state, 1, 2)
  leaf = max((p for p in (directory / "2" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(leaf.read_bytes())
  data[len(data) // 2] ^= 0xFF
  leaf.write_bytes(bytes(data))
  with pytest.raises(CorruptCheckpointError, match=r"step 2 is corrupt, steps that restore: \[1\] \(pass --step=1\)"):
    state_lib.restore_params(str(tmp_path), run.layout)
  assert sorted(os.listdir(directory)) == ["1", "2"]
  params, step = state_lib.restore_params(str(tmp_path), run.layout, step=1)
  assert step == 1
  assert_same_bytes(params, run.state["params"])


def test_set_aside_renames_to_a_name_that_is_no_step(run, tmp_path):
  """`set_aside` keeps the step's files under `<step>.corrupt` (then `.corrupt.2`), which Orbax lists as no
  step: the newest step is the one before."""
  directory = tmp_path / "checkpoints"
  with opened(directory) as ck:
    for step in (1, 2):
      ck.save(step, run.state)
    ck.wait()
    assert ck.set_aside(2) == str(directory / "2.corrupt")
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    ck.save(2, run.state)
    ck.wait()
    assert ck.set_aside(2) == str(directory / "2.corrupt.2")
  assert ckpt_lib.set_aside_steps(str(directory)) == ["2.corrupt", "2.corrupt.2"]
  with opened(directory) as ck:
    assert ck.latest_step() == 1
