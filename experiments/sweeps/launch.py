"""Launching a sweep's points idempotently: a re-launch skips done points and re-runs the others in their
workdirs, where moc_jax.main resumes from the newest checkpoint; locally, on a TPU pod or through slurm.
Ctrl-C and SIGTERM stop the runs at a checkpoint. The points come from experiments/sweeps/plan.py, the
directory's layout is experiments/sweeps/runs.py.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from experiments.sweeps.plan import Point, compute, config_flags, is_moc
from experiments.sweeps.runs import LOG, MANIFEST, finished, latest_checkpoint, read_manifest, write_manifest
from moc_jax.errors import ConfigError

BACKENDS = ("local", "tpu_pod", "slurm")
# JAX's persistent compilation cache shared by a sweep's local runs (unless JAX_COMPILATION_CACHE_DIR is set): a
# program compiled by one run is loaded by the next; the executable is the same, so are the losses.
COMPILATION_CACHE = ".xla_cache"


def commands(backend: str, spec: str, point: Point, workdir: str, backend_args=(),
             launch_dir: str = "launch") -> list[list[str]]:
  """What runs `point`, in order; each blocks until the run ends and exits non-zero if it failed.

  local: moc_jax.main under this interpreter. tpu_pod: launch/tpu_pod.sh run on every worker of the slice
  (backend_args: --name, --zone, ...), then its `logs` copies config.json and metrics.jsonl into the local
  workdir (checkpoints stay on the pod). slurm: `sbatch --wait` of launch/slurm_gpu.sbatch (backend_args go
  to sbatch, e.g. --nodes=4), the job's output in the workdir. `launch_dir`: where those scripts are (the
  repository's launch/; launch/sweep.py passes its own directory)."""
  main_args = [f"--config={spec}", f"--workdir={workdir}", *config_flags(point.overrides)]
  backend_args = list(backend_args)
  if backend == "local":
    return [[sys.executable, "-m", "moc_jax.main", *main_args]]
  if backend == "tpu_pod":
    tpu = os.path.relpath(os.path.join(launch_dir, "tpu_pod.sh"))
    return [[tpu, "run", *backend_args, "--", *main_args],
            [tpu, "logs", *backend_args, f"--workdir={workdir}", f"--local_dir={os.path.dirname(workdir)}"]]
  if backend == "slurm":
    return [["sbatch", "--wait", f"--output={os.path.join(workdir, 'slurm-%j.out')}", *backend_args,
             os.path.relpath(os.path.join(launch_dir, "slurm_gpu.sbatch")), "--", *main_args]]
  raise ValueError(f"unknown backend {backend!r}; known: {list(BACKENDS)}")


def was_killed(entry: dict) -> bool:
  """The manifest says the run is running, yet a launcher is reading it anew: the launch that ran it was killed
  (SIGKILL, a lost machine) before it could record how the attempt ended."""
  return entry.get("status") == "running" and "started" in entry


def killed_wall_s(entry: dict, workdir: str) -> float:
  """The wall time of a killed launch's run (was_killed): from its start to its log's last write, so that a
  study's stated compute counts every attempt."""
  if not was_killed(entry):
    return 0.0
  try:
    return round(max(0.0, os.path.getmtime(os.path.join(workdir, LOG)) - entry["started"]), 1)
  except OSError:  # no log: the run never started
    return 0.0


class Launcher:
  """Runs the points that are not done, `parallel` at a time, keeping manifest.jsonl current.

  Ctrl-C sends SIGTERM to the running commands (moc_jax.main then saves a checkpoint and exits), marks
  them pending and starts nothing more; the same command later resumes them. `launch_dir`: see `commands`;
  `python_path`: directories put first on the runs' PYTHONPATH (launch/sweep.py: the repository, so an
  uninstalled checkout runs its own moc_jax); `first`: names of points to start before the others (order)."""

  def __init__(self, sweep_dir, spec, sweep, points, backend="local", backend_args=(), out=None,
               launch_dir="launch", python_path=(), first=()):
    self.dir, self.points, self.backend, self.out = sweep_dir, points, backend, out or sys.stdout
    self.python_path, self.first = tuple(python_path), frozenset(first)
    previous = {e["name"]: e for e in read_manifest(sweep_dir)}
    for e in previous.values():
      if (e.get("config"), e.get("sweep")) != (spec, sweep):
        raise ConfigError(f"{sweep_dir} holds sweep {e.get('sweep')!r} of {e.get('config')!r}, not {sweep!r} of "
                          f"{spec!r}; pass another --name")
    self.entries, self.cmds = {}, {}
    for p in points:
      workdir = os.path.join(sweep_dir, p.name)
      self.cmds[p.name] = commands(backend, spec, p, workdir, backend_args, launch_dir)
      old = previous.get(p.name, {})
      status = ("done" if finished(workdir, p.config.train.steps) else
                "failed" if old.get("status") == "failed" else "pending")
      self.entries[p.name] = {
          "name": p.name, "overrides": p.overrides, "workdir": workdir,
          "command": " && ".join(shlex.join(c) for c in self.cmds[p.name]), "status": status,
          "returncode": old.get("returncode"), "wall_s": old.get("wall_s", 0.0) + killed_wall_s(old, workdir),
          "attempts": old.get("attempts", 0) + was_killed(old),
          "steps": p.config.train.steps, "config": spec, "sweep": sweep, "backend": backend}
    # Runs of an earlier version of the sweep stay listed: their workdirs are still there.
    self.others = [e for name, e in previous.items() if name not in self.entries]
    self.lock, self.procs, self.stopping = threading.Lock(), set(), False

  def describe(self) -> None:
    """The plan (--dry-run): each point's FLOPs (a vanilla point's mismatch to the nearest MoC point) and
    what a launch would do with it."""
    costs = {p.name: compute(p.config) for p in self.points}
    moc = {p.name: costs[p.name]["flops_per_token"] for p in self.points if is_moc(p.config)}
    for p in self.points:
      e, per_token = self.entries[p.name], costs[p.name]["flops_per_token"]
      iso = ""
      if moc and not is_moc(p.config):
        nearest = min(moc, key=lambda n: abs(moc[n] - per_token))
        iso = f" ({per_token / moc[nearest] - 1:+.1%} vs {nearest})"
      state = e["status"]
      if state == "done":
        state += " (skipped)"
      elif latest_checkpoint(e["workdir"]) is not None:
        state += f", resumes from step {latest_checkpoint(e['workdir'])}"
      print(f"# {p.name}: {'moc' if is_moc(p.config) else 'dense'}, {per_token:,.0f} model FLOPs/token{iso}, "
            f"{costs[p.name]['train_flops']:.3g} training FLOPs; {state}", file=self.out)
      if e["status"] != "done":
        for cmd in self.cmds[p.name]:
          print(shlex.join(cmd), file=self.out)

  def run(self, parallel=1) -> dict:
    """Launches every point that is not done; returns {status: count} over the sweep's points."""
    os.makedirs(self.dir, exist_ok=True)
    todo = self.order(parallel)
    self._save()
    print(f"sweep {self.dir}: {len(self.points) - len(todo)} of {len(self.points)} points done, running "
          f"{len(todo)} ({self.backend}, {parallel} at a time)", file=self.out, flush=True)
    with stop_signals(), concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
      futures = []
      try:  # the signal may come while the points are being submitted
        for name in todo:
          futures.append(pool.submit(self._run_point, name))
        wait_all(futures)
      except KeyboardInterrupt:
        with self.lock:
          self.stopping = True
          for proc in self.procs:
            proc.terminate()
        print("sweep: interrupted; running points stop at a checkpoint, re-run the same command to resume",
              file=self.out, flush=True)
        concurrent.futures.wait(futures)
    counts = {}
    for e in self.entries.values():
      counts[e["status"]] = counts.get(e["status"], 0) + 1
    return counts

  def order(self, parallel) -> list[str]:
    """The points not done, in the order they start: those of `first` before the others (a harness whose verdict
    waits on some runs gets them first, while the others fill the slots they leave), and within each group the
    plan's order one at a time; the most training FLOPs left (from the newest checkpoint) first when several run at
    once, so that the group ends when its longest run does, not after a long run started last."""
    todo = [p for p in self.points if self.entries[p.name]["status"] != "done"]
    if parallel > 1:
      def left(p):
        steps, done = p.config.train.steps, latest_checkpoint(self.entries[p.name]["workdir"]) or 0
        return compute(p.config)["train_flops"] * max(steps - done, 0) / steps
      todo.sort(key=left, reverse=True)
    todo.sort(key=lambda p: p.name not in self.first)  # stable: each group keeps its order
    return [p.name for p in todo]

  def _save(self):
    write_manifest(self.dir, [*self.entries.values(), *self.others])

  def _run_point(self, name):
    e = self.entries[name]
    with self.lock:
      if self.stopping:
        return
      e["status"], e["started"] = "running", round(time.time(), 1)
      self._save()
    os.makedirs(e["workdir"], exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (*self.python_path, os.environ.get("PYTHONPATH")) if p)}
    if self.backend == "local":  # a sweep's runs compile the same programs (seeds, shared evaluations): once each
      env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(self.dir, COMPILATION_CACHE))
    t0, rc = time.time(), 0
    with open(os.path.join(e["workdir"], LOG), "a") as log:
      for cmd in self.cmds[name]:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        with self.lock:
          if self.stopping:
            break
          try:  # a session of its own: Ctrl-C reaches only the sweep, which stops the run with SIGTERM
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
          except OSError as err:  # e.g. no sbatch on this machine
            log.write(f"{err}\n")
            rc = 127
            break
          self.procs.add(proc)
        rc = proc.wait()
        with self.lock:
          self.procs.discard(proc)
        if rc:
          break
    with self.lock:
      done = finished(e["workdir"], e["steps"])
      # Exit 0 unfinished: the run was stopped from outside (a pre-emption) and saved a checkpoint to resume.
      e.update(returncode=rc, wall_s=round(e["wall_s"] + time.time() - t0, 1), attempts=e["attempts"] + 1,
               status="done" if done else "pending" if self.stopping or rc == 0 else "failed")
      e.pop("started")
      self._save()
      print(f"sweep: {name} {e['status']} (exit {rc}) after {time.time() - t0:.0f} s; log {e['workdir']}/{LOG}",
            file=self.out, flush=True)


def wait_all(futures) -> None:
  """Waits for every future, raising the first failure, a second at a time: so that a Ctrl-C (or a SIGTERM
  under stop_signals) delivered while the pool's threads work is still raised here, in the main thread."""
  running = set(futures)
  while running:
    finished_now, running = concurrent.futures.wait(running, timeout=1.0)
    for f in finished_now:
      f.result()


@contextlib.contextmanager
def stop_signals():
  """Ctrl-C and SIGTERM both stop a launch the same way (its runs save a checkpoint; the same command
  resumes). SIGINT gets Python's handler back even where it was ignored: a shell starts `cmd &` with SIGINT
  ignored, so without this a backgrounded sweep could be stopped only by killing it, which leaves its runs
  (each in a session of its own) going. Signal handlers can only be set from the main thread."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def interrupt(signum, frame):
    raise KeyboardInterrupt

  previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
  try:
    yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def run_to_completion(sweep_dir, spec, sweep, points, parallel, harness, first=()) -> None:
  """Runs `points` in sweep_dir until each is done (a stage of a harness such as experiments.retention; finished
  points are skipped and interrupted ones resume, as with launch/sweep.py), with the current directory first
  on the runs' PYTHONPATH, the points named in `first` started first (Launcher.order). Stops the harness, naming
  what to look at, when any point did not finish."""
  counts = Launcher(sweep_dir, spec, sweep, points, python_path=(os.getcwd(),), first=first).run(parallel)
  if counts.get("done", 0) != len(points):
    raise SystemExit(f"{harness}: {sweep} finished {counts.get('done', 0)} of {len(points)} runs ({counts}); "
                     f"see {sweep_dir}/{MANIFEST} and each run's {LOG}, then re-run the same command")
