"""Faults and their recovery, end to end: a killed, interrupted or corrupted run resumes exactly; what must be
refused (a second run on a workdir, a resume with another model) changes nothing; non-finite updates are skipped
and never saved. docs/reliability.md points here."""
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moc_jax
from moc_jax import main as main_lib
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.errors import CorruptCheckpointError, TrainingError
from moc_jax.train import loop as loop_lib
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIGNALLED = {"train.steps": 40, "train.checkpoint_every": 1000, "train.eval_every": 1000}
CORRUPTED = {"train.steps": 6, "train.checkpoint_every": 2, "train.eval_every": 2}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


class _Main:
  """`python -m moc_jax.main` in a subprocess, its output in a file (a pipe could fill and block it)."""

  def __init__(self, args, log_path):
    env = {**os.environ, "CI": "1", "JAX_PLATFORMS": "cpu"}
    self.log_path = log_path
    with open(log_path, "w") as log:
      self.proc = subprocess.Popen([sys.executable, "-m", "moc_jax.main", *args], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)

  def poll(self):
    return self.proc.poll()

  def output(self):
    return open(self.log_path).read()

  def finish(self, timeout=600):
    self.proc.wait(timeout=timeout)
    return self.proc.returncode, self.output()


def _main(args, log_path):
  return _Main(args, log_path)


def _wait_for_checkpoint(workdir, step, proc, timeout=300):
  path = os.path.join(workdir, "checkpoints", str(step))
  t0 = time.time()
  while not os.path.isdir(path):
    assert proc.poll() is None, proc.output()
    assert time.time() - t0 < timeout, "no checkpoint appeared"
    time.sleep(0.05)


@pytest.mark.slow  # two full runs and a kill (about 2 minutes); the SIGTERM and Ctrl-C resumes below stay in the suite
def test_resume_after_sigkill_gives_identical_losses(data_dir, tmp_path):
  extra = {"train.steps": 8, "train.checkpoint_every": 3, "train.eval_every": 4}
  ref = _main(tu.cli_args("configs/moc.py:tiny", data_dir, tmp_path / "ref", **extra), tmp_path / "ref.log")
  code, out = ref.finish()
  assert code == 0, out
  killed = _main(tu.cli_args("configs/moc.py:tiny", data_dir, tmp_path / "run", **extra), tmp_path / "kill.log")
  _wait_for_checkpoint(tmp_path / "run", 3, killed)
  time.sleep(0.3)  # let it run on past the checkpoint: rows after it must be discarded on resume
  killed.proc.send_signal(signal.SIGKILL)
  killed.proc.wait()
  resumed = _main(tu.cli_args("configs/moc.py:tiny", data_dir, tmp_path / "run", **extra), tmp_path / "res.log")
  code, out = resumed.finish()
  assert code == 0, out
  assert "resumed" in out
  assert tu.train_losses(tmp_path / "run") == tu.train_losses(tmp_path / "ref")
  val = lambda w: [(r["step"], r["ce"]) for r in tu.read_metrics(w) if r.get("split")]
  assert val(tmp_path / "run") == val(tmp_path / "ref")


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
  """The signalled runs' reference: the same command, never interrupted."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  code, out = _main(tu.cli_args("configs/vanilla.py:tiny", data_dir, workdir, **SIGNALLED), workdir / "log").finish()
  assert code == 0, out
  return workdir


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT])
def test_sigterm_and_ctrl_c_save_and_the_same_command_resumes_identically(sig, data_dir, uninterrupted, tmp_path):
  """The signal lands mid-run: the run saves at the step boundary, says how to resume and exits 0; the same
  command then finishes the run with the losses of one never interrupted."""
  args = tu.cli_args("configs/vanilla.py:tiny", data_dir, tmp_path / "run", **SIGNALLED)
  proc = _main(args, tmp_path / "log")
  metrics = tmp_path / "run" / "metrics.jsonl"
  t0 = time.time()
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None and time.time() - t0 < 300, proc.output()
    time.sleep(0.05)
  proc.proc.send_signal(sig)
  code, out = proc.finish(timeout=300)
  assert code == 0, out
  assert f"{sig.name} — checkpoint saved at step" in out and "re-run the same command to resume" in out
  assert "Traceback" not in out
  steps = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit())
  assert len(steps) == 1 and 2 <= steps[0] < SIGNALLED["train.steps"]  # the signal lands after step 2 logged
  code, out = _main(args, tmp_path / "resume.log").finish()
  assert code == 0 and f"resumed {tmp_path / 'run'} from step {steps[0]}" in out, out
  assert tu.train_losses(tmp_path / "run") == tu.train_losses(uninterrupted)


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
  """A finished 6-step run with checkpoints 2, 4 and 6: the corruption tests' reference and starting point."""
  workdir = tmp_path_factory.mktemp("finished")
  main_lib.train(moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir, **CORRUPTED)), str(workdir))
  return workdir


def _largest_params_file(step_dir):
  files = [p for p in glob.glob(os.path.join(step_dir, "params", "**", "*"), recursive=True) if os.path.isfile(p)]
  return max(files, key=os.path.getsize)


def _flip_bytes(step_dir, at=0.5):
  """Inverts 16 bytes of the parameter data, `at` of the way into its largest file: in a block stored raw they
  still decode, as different numbers; in a compressed block or the file's index the step cannot be read at all
  (the case _truncate tests). Where the arrays land in the file varies from save to save."""
  path = _largest_params_file(step_dir)
  data = bytearray(open(path, "rb").read())
  start = int(len(data) * at)
  data[start:start + 16] = bytes(b ^ 0xFF for b in data[start:start + 16])
  open(path, "wb").write(bytes(data))


FLIPS_AT = (0.5, 0.25, 0.75, 0.375, 0.625)  # where _flip_bytes tries, until the bytes it flips still decode


def _truncate(step_dir):
  path = _largest_params_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("corrupt, detected", [(_flip_bytes, "arrays differ from what was saved"),
                                               (_truncate, "cannot be read")])
def test_a_corrupt_checkpoint_is_set_aside_and_the_run_resumes_from_the_step_before(
    corrupt, detected, data_dir, finished, tmp_path, caplog, capfd):
  """The newest step is damaged on disk. Re-running the command warns once, naming the step and where it was
  set aside (renamed, its bytes kept), resumes from step 4 and writes the losses of the uninterrupted run, bit
  for bit; nothing reaches the terminal as a traceback."""
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir, **CORRUPTED))
  tries = [lambda d, at=at: _flip_bytes(d, at) for at in FLIPS_AT] if corrupt is _flip_bytes else [corrupt]
  for i, damage in enumerate(tries):
    workdir = tmp_path / f"run{i}"
    shutil.copytree(finished, workdir)
    damage(str(workdir / "checkpoints" / "6"))
    damaged = {p.relative_to(workdir / "checkpoints" / "6"): p.read_bytes()
               for p in (workdir / "checkpoints" / "6").rglob("*") if p.is_file()}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moc_jax"):
      main_lib.train(config, str(workdir))
    warnings = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    if corrupt is not _flip_bytes or "cannot be read" not in "".join(warnings):
      break  # a flip that left the step unreadable is _truncate's case: flip elsewhere
  aside = workdir / "checkpoints" / "6.corrupt"
  assert len(warnings) == 1 and detected in warnings[0] and f"set aside as {aside}" in warnings[0], warnings
  assert f"resumed {workdir} from step 4" in caplog.text
  assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == damaged
  assert tu.train_losses(workdir) == tu.train_losses(finished)
  val = lambda w: [(r["step"], r["ce"]) for r in tu.read_metrics(w) if r.get("split")]
  assert val(workdir) == val(finished)
  assert "Traceback" not in capfd.readouterr().err


def test_when_no_step_restores_the_run_is_refused_and_its_metrics_kept(data_dir, finished, tmp_path):
  """Every step corrupt: each is set aside, and the run stops with a CheckpointError instead of starting again
  from step 0 in the same workdir (which would drop metrics.jsonl's rows); so does the next attempt."""
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  for step in (2, 4, 6):
    _truncate(str(workdir / "checkpoints" / str(step)))
  metrics = (workdir / "metrics.jsonl").read_bytes()
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir, **CORRUPTED))
  for _ in range(2):
    with pytest.raises(moc_jax.CheckpointError, match="no checkpoint under .* restores .*2.corrupt, 4.corrupt, 6.corrupt"):
      main_lib.train(config, str(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2.corrupt", "4.corrupt", "6.corrupt"]
  assert (workdir / "metrics.jsonl").read_bytes() == metrics


def test_a_refused_resume_leaves_the_workdir_as_it_was(data_dir, tmp_path):
  """Resuming with a model the checkpoint does not fit is refused as a config mismatch (not corruption), and
  every file is as it was: config.json (what `moc_jax.eval` reads the run with) still describes the run that
  wrote the checkpoint, and no step is renamed."""
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir))
  main_lib.train(config, str(tmp_path))
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  other = moc_jax.load_config("configs/vanilla.py:tiny", {**tu.overrides(data_dir), "model.mlp_dim": 96})
  with pytest.raises(moc_jax.CheckpointError, match="does not match this config") as info:
    main_lib.train(other, str(tmp_path))
  assert not isinstance(info.value, CorruptCheckpointError)  # a config mismatch: nothing is set aside
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_resuming_with_another_bank_optimizer_is_refused_by_name(data_dir, tmp_path):
  """A dense-AdamW MoC run resumed with lazy_adam: one ConfigError naming the setting the run was trained with
  and the way out, the workdir as it was; smf after lazy_adam (the same state layout) is not refused."""
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir))
  main_lib.train(config, str(tmp_path))
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  lazy = moc_jax.load_config("configs/moc.py:tiny", {**tu.overrides(data_dir), "train.bank_optimizer": "lazy_adam"})
  want = (r"config\.train\.bank_optimizer: .* was trained with train\.bank_optimizer=dense and this config has "
          r"train\.bank_optimizer=lazy_adam.*--config\.train\.bank_optimizer=dense.*--config\.train\.init_from=")
  with pytest.raises(moc_jax.ConfigError, match=want):
    main_lib.train(lazy, str(tmp_path))
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
  assert loop_lib._bank_state_kind({"bank_optimizer": "smf"})[0] == loop_lib._bank_state_kind(lazy.train.to_dict())[0]



@pytest.mark.slow
def test_nonfinite_updates_are_skipped_counted_and_never_saved(data_dir, tmp_path, monkeypatch):
  """Poison the loss on a data-dependent subset of steps; those updates must leave the state as it was."""
  from moc_jax.train import step as step_lib
  real = step_lib.lm_loss

  def poisoned(model, batch, *, train):
    loss, aux = real(model, batch, train=train)
    bad = jnp.sum(batch["input_ids"]) % 2 == 1
    return jnp.where(bad, jnp.nan, loss), aux

  monkeypatch.setattr(step_lib, "lm_loss", poisoned)
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(
      data_dir, **{"train.steps": 6, "train.checkpoint_every": 1, "train.max_nonfinite": 100,
                   "train.keep_checkpoints": 10}))
  main_lib.train(config, str(tmp_path))
  rows = [r for r in tu.read_metrics(tmp_path) if "split" not in r]
  skipped = [r["skipped_nonfinite"] for r in rows]
  n_bad = [b - a for a, b in zip([0] + skipped, skipped)]
  assert 0 < skipped[-1] < 6, skipped
  from moc_jax.checkpoint import Checkpointer
  ck = Checkpointer(str(tmp_path / "checkpoints"), keep=10)
  abstract = state_lib.build_state(config, sharding.make_mesh(config)).abstract
  from moc_jax.data import make_train_iterator
  prev = None
  for step, bad in zip(range(1, 7), n_bad):
    state = ck.restore(step, abstract, make_train_iterator(state_lib.micro_batch_config(config)))
    leaves = [np.asarray(x) for x in jax.tree.leaves(state["params"])]
    assert all(np.isfinite(x).all() for x in leaves)
    if prev is not None and bad:
      assert all(np.array_equal(a, b) for a, b in zip(prev, leaves)), f"step {step} was skipped but changed params"
    prev = leaves
  ck.close()


def test_too_many_nonfinite_updates_stop_the_run(data_dir, tmp_path, monkeypatch):
  from moc_jax.train import step as step_lib
  real = step_lib.lm_loss
  monkeypatch.setattr(step_lib, "lm_loss", lambda m, b, *, train: (jnp.nan * real(m, b, train=train)[0],
                                                                   real(m, b, train=train)[1]))
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(
      data_dir, **{"train.steps": 10, "train.max_nonfinite": 3}))
  with pytest.raises(TrainingError, match="3 consecutive non-finite"):
    main_lib.train(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints" / "3")



def test_one_training_run_per_workdir(data_dir, tmp_path, caplog):
  """A second run on a workdir in use is refused, naming the holder, and writes nothing there; a lock left
  by a run that died without releasing it (its pid in the file, no flock held) is taken over."""
  from moc_jax.train.workdir_lock import LOCK_FILE, workdir_lock
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir))
  with workdir_lock(str(tmp_path)):
    with pytest.raises(TrainingError, match=f"in use by another training run \\(pid {os.getpid()} on host"):
      main_lib.train(config, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
  (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 999999, "started": "2026-01-01 00:00:00"}))
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    main_lib.train(config, str(tmp_path))
  assert "(pid 999999 on host h, started 2026-01-01 00:00:00) taken over" in caplog.text
  assert (tmp_path / LOCK_FILE).read_text() == ""  # released
