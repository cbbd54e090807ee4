"""The studies' evaluation runner (experiments/evaluation.py): which runs it evaluates and how, its stop on a
signal, and the time each evaluation took, with `python -m moc_jax.eval` faked."""
import json
import os
import signal
import threading

import pytest

from experiments import evaluation


def _fake_eval(commands, rc=None, running=1):
  """subprocess.Popen for `python -m moc_jax.eval`: records each command; exits with `rc`, or (rc None) runs until
  terminated, then exits as SIGTERM leaves it. `started` is set once `running` have started."""
  class Eval:
    started = threading.Event()

    def __init__(self, command, **kw):
      commands.append(command)
      self.terminated = threading.Event()
      if len(commands) >= running:
        Eval.started.set()

    def wait(self):
      if rc is not None:
        return rc
      assert self.terminated.wait(60), "never terminated"
      return -signal.SIGTERM

    def terminate(self):
      self.terminated.set()
  return Eval


def test_sigterm_stops_the_evaluations_and_the_harness(tmp_path, monkeypatch):
  """SIGTERM (or Ctrl-C) while evaluations run terminates them and ends the harness with one line; nothing counts
  them as evaluated, so the same command evaluates them again, and the signal handlers are restored."""
  runs = [tmp_path / name for name in ("a", "b", "c")]
  for run in runs:
    run.mkdir()
  commands = []
  fake = _fake_eval(commands, running=2)
  monkeypatch.setattr(evaluation.subprocess, "Popen", fake)
  handler = signal.getsignal(signal.SIGTERM)
  threading.Thread(target=lambda: fake.started.wait(60) and os.kill(os.getpid(), signal.SIGTERM)).start()
  with pytest.raises(SystemExit, match="harness: interrupted; the evaluations that had not finished run again"):
    evaluation.evaluate_runs([(str(r), True) for r in runs], 2, "harness")
  assert len(commands) == 2  # the third never started
  assert not any((r / evaluation.EVAL_TIME).exists() for r in runs)
  assert signal.getsignal(signal.SIGTERM) is handler


def test_evaluates_runs_without_an_ablated_eval_json(tmp_path, monkeypatch):
  """A MoC run is evaluated unless its eval.json already has the bank knocked out, and the command asks for it;
  a vanilla run is evaluated once, without an ablation."""
  runs = {name: tmp_path / name for name in ("new", "old", "done", "dense-new", "dense-done")}
  for run in runs.values():
    run.mkdir()
  (runs["old"] / "eval.json").write_text(json.dumps({"ce": 1.0}))
  (runs["done"] / "eval.json").write_text(json.dumps({"ce": 1.0, "ablation": {"spec": "routed"}}))
  (runs["dense-done"] / "eval.json").write_text(json.dumps({"ce": 1.0}))
  commands = []
  monkeypatch.setattr(evaluation.subprocess, "Popen", _fake_eval(commands, rc=0))
  evaluation.evaluate_runs([(str(r), not name.startswith("dense")) for name, r in runs.items()], 1, "harness")
  assert [c[3:] for c in commands] == [[f"--workdir={runs['new']}", "--ablate_chapters=routed"],
                                       [f"--workdir={runs['old']}", "--ablate_chapters=routed"],
                                       [f"--workdir={runs['dense-new']}"]]
  # Each evaluation's time is kept beside it, so a resumed harness still counts it; a failed one is not kept.
  assert [evaluation.eval_seconds(str(r)) >= 0 and (r / evaluation.EVAL_TIME).exists() for r in runs.values()] == [
      True, True, False, True, False]
  monkeypatch.setattr(evaluation.subprocess, "Popen", _fake_eval([], rc=1))
  (runs["new"] / evaluation.EVAL_TIME).unlink()
  with pytest.raises(SystemExit, match="harness: the evaluation of 1 run"):
    evaluation.evaluate_runs([(str(runs["new"]), True)], 1, "harness")
  assert evaluation.eval_seconds(str(runs["new"])) == 0.0
