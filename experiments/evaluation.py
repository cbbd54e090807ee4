"""Evaluating a harness's finished runs with `python -m moc_jax.eval`, as the studies share it
(experiments.routing_evidence, experiments.capacity): each run once, a run with memory layers also with its
memory knocked out (`--ablate_chapters=routed`: every routable chapter, or every value slot, zeroed), so the
report can say how much of the run's fact recall the memory holds.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

from experiments.sweeps import report
from experiments.sweeps.launch import stop_signals, wait_all

EVAL_TIME = "eval_time.json"  # in a run's workdir: how long the harness's evaluation of it took


def evaluate_runs(runs, parallel, harness) -> None:
  """`python -m moc_jax.eval` on each run (`runs`: (workdir, has memory) pairs) not yet evaluated, `parallel` at
  a time (log: eval.log): a run with memory also with every routable chapter zeroed (`--ablate_chapters=routed`),
  so one whose eval.json has no ablation (written before the harness asked for one) is evaluated again; a run
  without memory once. Ctrl-C or SIGTERM stops the running evaluations and the harness (`harness` names it in the
  message); the same command evaluates them again."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
  lock, running, stopping = threading.Lock(), set(), threading.Event()

  def one(run):
    workdir, memory = run
    t0 = time.time()
    with open(os.path.join(workdir, "eval.log"), "w") as log:
      command = [sys.executable, "-m", "moc_jax.eval", f"--workdir={workdir}"]
      command += ["--ablate_chapters=routed"] if memory else []
      with lock:
        if stopping.is_set():
          return workdir, None
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        running.add(proc)
      rc = proc.wait()
      with lock:
        running.discard(proc)
    if not rc:
      with open(os.path.join(workdir, EVAL_TIME), "w") as f:
        json.dump({"seconds": round(time.time() - t0, 1)}, f)
    return workdir, rc

  todo = [(w, memory) for w, memory in runs if not evaluated(w, memory)]
  with stop_signals(), concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = []
    try:  # the signal may come while the evaluations are being submitted
      for run in todo:
        futures.append(pool.submit(one, run))
      wait_all(futures)
    except KeyboardInterrupt:
      with lock:
        stopping.set()
        for proc in running:
          proc.terminate()
      concurrent.futures.wait(futures)
      raise SystemExit(f"{harness}: interrupted; the evaluations that had not finished run again when the "
                       "same command is re-run") from None
  failed = [w for w, rc in (f.result() for f in futures) if rc]
  if failed:
    raise SystemExit(f"{harness}: the evaluation of {len(failed)} run(s) failed; see {failed[0]}/eval.log, then "
                     "re-run the same command")


def evaluated(workdir, memory) -> bool:
  """The run has the evaluation evaluate_runs makes: with its memory knocked out too if it has memory."""
  found = report.eval_report(workdir)
  return "ablation" in found if memory else bool(found)


def eval_seconds(workdir) -> float:
  """How long the run's evaluation took, whichever invocation of the harness ran it (0 if unrecorded)."""
  try:
    with open(os.path.join(workdir, EVAL_TIME)) as f:
      return json.load(f)["seconds"]
  except FileNotFoundError:
    return 0.0
