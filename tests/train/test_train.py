"""The main job end to end: training, resume after SIGKILL, SIGTERM checkpoint, non-finite updates."""
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.errors import TrainingError
from moc_jax.eval import evaluate
from moc_jax import main as main_lib
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.mark.parametrize("spec", ["configs/moc.py:tiny", "configs/vanilla.py:tiny"])
def test_two_steps_write_every_artifact(spec, data_dir, tmp_path):
  config = moc_jax.load_config(spec, tu.overrides(data_dir))
  last = main_lib.train(config, str(tmp_path))
  rows = tu.read_metrics(tmp_path)
  train = [r for r in rows if "split" not in r]
  evals = [r for r in rows if r.get("split") == "validation"]
  assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
  for key in ("loss", "ce", "aux", "lr", "grad_norm", "tokens_per_s", "data_wait_frac", "mfu"):
    assert math.isfinite(train[-1][key]), key
  assert train[0]["lr"] == 0.0  # λ(0) = 0 on the first update
  assert (train[-1]["aux"] > 0) == spec.startswith("configs/moc.py")
  assert 0.0 <= evals[0]["probe_acc"] <= 1.0 and evals[0]["ce"] > 0
  assert last["step"] == 2
  for name in ("config.json", "loss.png", "checkpoints", "tensorboard"):
    assert os.path.exists(tmp_path / name), name
  assert json.load(open(tmp_path / "config.json"))["model"]["d_model"] == config.model.d_model
  from moc_jax.eval import EvalOptions  # --mode=eval on the saved checkpoint (routing analysis: tests/eval/test_run.py)
  again = evaluate(config, str(tmp_path), EvalOptions(analyze_routing=False))
  assert again["step"] == 2 and again["ce"] == pytest.approx(evals[-1]["ce"], rel=1e-6)


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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_save_a_checkpoint_and_exit_cleanly(sig, data_dir, tmp_path):
  extra = {"train.steps": 1000, "train.checkpoint_every": 1000, "train.eval_every": 1000}
  proc = _main(tu.cli_args("configs/vanilla.py:tiny", data_dir, tmp_path / "run", **extra), tmp_path / "log")
  metrics = tmp_path / "run" / "metrics.jsonl"
  t0 = time.time()
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None and time.time() - t0 < 300, proc.output()
    time.sleep(0.05)
  proc.proc.send_signal(sig)
  code, out = proc.finish(timeout=300)
  assert code == 0, out
  assert f"{sig.name} — checkpoint saved at step" in out and "re-run the same command to resume" in out
  steps = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit())
  assert len(steps) == 1 and 2 <= steps[0] < 1000  # the signal lands after step 2 logged


def test_a_refused_resume_leaves_the_workdir_as_it_was(data_dir, tmp_path):
  """Resuming with a model the checkpoint does not fit is refused, and config.json (what `moc_jax.eval` reads
  the run with) still describes the run that wrote the checkpoint."""
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data_dir))
  main_lib.train(config, str(tmp_path))
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  other = moc_jax.load_config("configs/vanilla.py:tiny", {**tu.overrides(data_dir), "model.mlp_dim": 96})
  with pytest.raises(moc_jax.CheckpointError, match="do not match|does not match"):
    main_lib.train(other, str(tmp_path))
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


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


def test_init_from_loads_weights_with_fresh_optimizer_and_step(data_dir, tmp_path):
  """The first update of the new run has lr 0 (λ(0) = 0), so its step-1 params equal the source's weights."""
  src = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir))
  main_lib.train(src, str(tmp_path / "src"))
  dst = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(
      data_dir, **{"train.steps": 1, "train.checkpoint_every": 1, "train.init_from": str(tmp_path / "src")}))
  main_lib.train(dst, str(tmp_path / "dst"))
  abstract = state_lib.build_state(dst, sharding.make_mesh(dst)).abstract
  from moc_jax.checkpoint import restore_params
  a, step_a = restore_params(str(tmp_path / "src"), abstract["params"])
  b, step_b = restore_params(str(tmp_path / "dst"), abstract["params"])
  assert (step_a, step_b) == (2, 1)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = [r for r in tu.read_metrics(tmp_path / "dst") if "split" not in r]
  assert [r["step"] for r in rows] == [1] and rows[0]["lr"] == 0.0


def test_resume_with_another_process_count_is_refused_with_the_fix(tmp_path):
  from moc_jax import checkpoint as ckpt_lib
  d = tmp_path / "data_iter"
  d.mkdir()
  for i in range(2):
    (d / f"process_{i}-of-2.json").write_text("{}")
  with pytest.raises(ckpt_lib.CheckpointError, match="saved by 2 processes.*init_from"):
    ckpt_lib._check_process_count(str(d))
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "process_0-of-1.json").write_text("{}")
  ckpt_lib._check_process_count(str(tmp_path / "one"))


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
