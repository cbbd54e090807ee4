"""Multi-host training: two CPU processes on localhost joined by jax.distributed train like one process.

Each process owns one CPU device and feeds only its half of every global batch; the losses must equal those
of a single process with the same config and seed. The config uses layout=pad_truncate (one record per row,
as the 262k paper run does): with it the two halves together hold exactly the single process's rows (in
another order), so the comparison is exact up to float32 summation order. With layout=pack the processes
pack different record sets (process p reads records p, p + 2, ...), so the rows differ by construction.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from moc_jax import distributed
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/moc.py:tiny"
OVERRIDES = {**tu.TINY_OVERRIDES, "train.steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3,
             "model.compute_dtype": "float32", "data.layout": "pad_truncate",
             # two layers (one memory layer) and no remat: the same code paths, half the compile time
             "model.num_layers": 2, "memory.layer_indices": [1], "model.remat": "none"}
TIMEOUT = 300


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(tmp_path, name, workdir, address=None, num_processes=None, process_id=None, **extra):
  """`python -m tests.sharding.multiprocess_worker` with one CPU device, its output in a file (a pipe could block it)."""
  env = {k: v for k, v in os.environ.items() if k not in distributed.ENV.values()}
  # XLA_FLAGS replaced: one CPU device per process, and LLVM -O0 (halves compile time; tiny steps run fast anyway).
  env.update(JAX_PLATFORMS="cpu", CI="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO,
             XLA_FLAGS="--xla_backend_optimization_level=0")
  spec = {"address": address, "num_processes": num_processes, "process_id": process_id, "config": CONFIG,
          "overrides": {**OVERRIDES, "data.data_dir": str(tmp_path / "data"), **extra}, "workdir": str(workdir),
          "out": str(tmp_path / f"{name}.json")}
  log = tmp_path / f"{name}.log"
  with open(log, "w") as f:
    proc = subprocess.Popen([sys.executable, "-m", "tests.sharding.multiprocess_worker", json.dumps(spec)], cwd=REPO,
                            env=env, stdout=f, stderr=subprocess.STDOUT)
  return name, proc, log


def _finish(procs, timeout=TIMEOUT):
  """Waits for all; if one fails or time runs out, kills the others (they would wait for it in a collective).
  Asserts each exited 0, showing the tails of the failed ones' logs."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    codes = [proc.poll() for _, proc, _ in procs]
    if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
      break
    time.sleep(0.1)
  for _, proc, _ in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  failed = [(name, proc.returncode, log) for name, proc, log in procs if proc.returncode != 0]
  assert not failed, "\n\n".join(f"--- {name} exited {code} (-9: killed after a failure or the {timeout}s timeout); "
                                 f"log tail:\n{''.join(open(log).readlines()[-40:])}" for name, code, log in failed)


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path, subtests):
  """A single-process reference run, then a 2-process run into one shared workdir (Orbax needs every process
  to write the same checkpoint directory). The reference runs first: it also builds the small corpus. One test
  (subtests for the checks), so that pytest-xdist never runs the processes twice."""
  t0 = time.time()
  _finish([_launch(tmp_path, "ref", tmp_path / "ref")])
  t1 = time.time()
  address = f"localhost:{_free_port()}"
  _finish([_launch(tmp_path, f"p{i}", tmp_path / "shared", address, 2, i) for i in range(2)])
  print(f"single process {t1 - t0:.1f}s, two processes {time.time() - t1:.1f}s")
  runs = {name: json.load(open(tmp_path / f"{name}.json")) for name in ("ref", "p0", "p1")}
  ref_dir, mp_dir = tmp_path / "ref", tmp_path / "shared"

  with subtests.test("one device per process; each feeds its half of every batch"):
    for i in range(2):
      r = runs[f"p{i}"]
      assert (r["process_index"], r["process_count"], r["local_devices"], r["devices"]) == (i, 2, 1, 2)
      assert r["iterator_args"] == [{"batch_size": OVERRIDES["train.batch_size"] // 2, "process_index": i,
                                     "process_count": 2}]
    assert runs["ref"]["iterator_args"] == [{"batch_size": OVERRIDES["train.batch_size"], "process_index": 0,
                                             "process_count": 1}]
    for step, ref_rows in enumerate(runs["ref"]["batches"], start=1):
      rows0, rows1 = (set(map(tuple, runs[p]["batches"][step - 1])) for p in ("p0", "p1"))
      assert not rows0 & rows1, f"step {step}: both processes fed the same rows"
      assert sorted(rows0 | rows1) == sorted(map(tuple, ref_rows)), f"step {step}: not the single process's rows"

  with subtests.test("train losses equal the single process's"):
    ref, mp = tu.train_losses(ref_dir), tu.train_losses(mp_dir)
    assert sorted(mp) == sorted(ref) == [1, 2, 3]
    np.testing.assert_allclose([mp[s] for s in sorted(mp)], [ref[s] for s in sorted(ref)], rtol=1e-5)
    for p in ("p0", "p1"):
      assert runs[p]["last"]["loss"] == pytest.approx(ref[3][0], rel=1e-5)

  with subtests.test("metrics.jsonl written once (by process 0)"):
    rows = [(r["step"], r.get("split")) for r in tu.read_metrics(mp_dir)]
    assert rows == [(0, "validation"), (1, None), (2, None), (3, None), (3, "validation")]

  with subtests.test("validation equals the single process's"):
    val = lambda w: {r["step"]: (r["ce"], r["tokens"], r["probe_acc"]) for r in tu.read_metrics(w) if r.get("split")}
    ref, mp = val(ref_dir), val(mp_dir)
    assert sorted(mp) == sorted(ref) == [0, 3]
    for step in ref:
      assert mp[step][1:] == ref[step][1:], f"step {step}: eval tokens / probe accuracy differ"
      assert mp[step][0] == pytest.approx(ref[step][0], rel=1e-5), f"step {step}: validation CE differs"

  with subtests.test("one checkpoint holds both processes' data iterators"):
    step_dir = mp_dir / "checkpoints" / "3"
    assert {"params", "opt_state", "step", "rng", "data_iter"} <= set(os.listdir(step_dir))
    assert sorted(p for p in os.listdir(step_dir / "data_iter") if p.endswith(".json")) == \
        ["process_0-of-2.json", "process_1-of-2.json"]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_at_one_checkpoint(tmp_path):
  """The save is collective: whichever process gets SIGTERM, all must save the same step and exit 0."""
  _finish([_launch(tmp_path, "prepare", tmp_path / "prepare", **{"train.steps": 1})])  # builds the corpus
  address = f"localhost:{_free_port()}"
  extra = {"train.steps": 1000, "train.eval_every": 1000, "train.checkpoint_every": 1000}
  procs = [_launch(tmp_path, f"p{i}", tmp_path / "shared", address, 2, i, **extra) for i in range(2)]
  metrics, t0 = tmp_path / "shared" / "metrics.jsonl", time.time()
  while not (metrics.exists() and '"step": 3,' in metrics.read_text()):
    if any(p.poll() is not None for _, p, _ in procs) or time.time() - t0 > TIMEOUT:
      _finish(procs, timeout=1)
      pytest.fail("the run ended or stalled before step 3")
    time.sleep(0.1)
  procs[1][1].send_signal(signal.SIGTERM)
  _finish(procs, timeout=120)
  steps = [int(s) for s in os.listdir(tmp_path / "shared" / "checkpoints") if s.isdigit()]
  assert len(steps) == 1 and 3 <= steps[0] < 1000, steps
  for _, _, log in procs:
    assert f"checkpoint saved at step {steps[0]}" in log.read_text()
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= \
      set(os.listdir(tmp_path / "shared" / "checkpoints" / str(steps[0]) / "data_iter"))


# --- initialize(): argument resolution and validation (jax.distributed.initialize mocked) ---------------

@pytest.fixture
def init_calls(monkeypatch):
  for var in distributed.ENV.values():
    monkeypatch.delenv(var, raising=False)
  calls, updates = [], []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  return calls, updates


def test_single_process_by_default(init_calls):
  assert distributed.initialize() is False
  assert init_calls == ([], [])


def test_explicit_values_initialise_with_gloo_cpu_collectives(init_calls):
  assert distributed.initialize("10.0.0.1:1234", 4, 3) is True
  assert init_calls[0] == [(("10.0.0.1:1234", 4, 3), {})]
  assert init_calls[1] == [("jax_cpu_collectives_implementation", "gloo")]


def test_env_vars_fill_in_and_explicit_values_win(init_calls, monkeypatch):
  monkeypatch.setenv("MOC_JAX_COORDINATOR_ADDRESS", "host-a:99")
  monkeypatch.setenv("MOC_JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("MOC_JAX_PROCESS_ID", "1")
  assert distributed.initialize() is True
  assert distributed.initialize(coordinator_address="host-b:7", process_id=0) is True
  assert [c[0] for c in init_calls[0]] == [("host-a:99", 2, 1), ("host-b:7", 2, 0)]


def test_enable_alone_lets_jax_detect_the_cluster(init_calls):
  assert distributed.initialize(enable=True) is True
  assert init_calls[0] == [((), {})]


@pytest.mark.parametrize("kwargs, env, match", [
    ({"coordinator_address": "h:1"}, {}, "--num_processes / MOC_JAX_NUM_PROCESSES and --process_id"),
    ({"coordinator_address": "h:1", "num_processes": 2}, {}, r"--process_id / MOC_JAX_PROCESS_ID must"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {}, r"\[0, num_processes=2\), got 2"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": -1}, {}, r"--process_id"),
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, {}, r"--num_processes .* >= 1"),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    ({"coordinator_address": "h:port", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    ({"coordinator_address": ":80", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    ({"coordinator_address": "h:70000", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    ({"num_processes": 2, "process_id": 0}, {}, "need --coordinator_address"),
    ({}, {"MOC_JAX_PROCESS_ID": "0"}, "need --coordinator_address / MOC_JAX_COORDINATOR_ADDRESS"),
    ({}, {"MOC_JAX_COORDINATOR_ADDRESS": "h:1", "MOC_JAX_NUM_PROCESSES": "two", "MOC_JAX_PROCESS_ID": "0"},
     "MOC_JAX_NUM_PROCESSES: expected an integer, got 'two'"),
    ({"coordinator_address": "h:1", "num_processes": 2.5, "process_id": 0}, {}, "expected an integer"),
])
def test_inconsistent_values_name_the_flag(init_calls, monkeypatch, kwargs, env, match):
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  with pytest.raises(ValueError, match=match):
    distributed.initialize(**kwargs)
  assert init_calls == ([], [])


def test_a_local_workdir_of_a_multi_process_run_is_named():
  """Each process writes its checkpoint shards to the workdir: with several, a path without a URL scheme may be
  each host's own disk, and the log says what the hosts need; a bucket or a single process says nothing."""
  note = distributed.workdir_note("runs/262k", 8)
  assert "8 processes" in note and "'runs/262k'" in note and "gs://" in note
  assert distributed.workdir_note("gs://bucket/runs/262k", 8) is None
  assert distributed.workdir_note("runs/262k", 1) is None
