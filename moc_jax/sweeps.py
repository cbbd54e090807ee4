"""Sweeps: named lists of config overrides defined beside the configs (`get_sweep(name, config)` in
configs/moc.py, big_vision's get_hyper), their run names, and launching them idempotently.

A sweep directory holds one workdir per point (named from its overrides, e.g. `k8-bank1040`) and
manifest.jsonl, one line per point: name, overrides, workdir, command, status (pending | running | done |
failed; a run stopped at a checkpoint is pending), return code, wall time. A point is done when its workdir
holds the validation row and (if it holds checkpoints/) the checkpoint of its last step; a re-launch skips
done points and re-runs the others in their workdirs, where moc_jax.main resumes from the newest checkpoint.
`python launch/sweep.py --help`; what the runs reached: moc_jax/sweep_report.py (launch/collect.py).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from moc_jax.config import config_module, memory_layers, validate
from moc_jax.errors import ConfigError

BACKENDS = ("local", "tpu_pod", "slurm")
MANIFEST = "manifest.jsonl"
LOG = "sweep.log"
BANK_KEYS = ("memory.num_tokens", "memory.num_chapters")
# Short run-name tags; any other field is named by its last component.
_TAGS = {"memory.top_k": "k", "memory.num_tokens": "bank", "model.mlp_dim": "mlp", "model.num_layers": "layers",
         "train.steps": "steps", "memory.load_balance": "", "memory.routing": "", "memory.routing_pool": "",
         "train.bank_lr": "banklr"}
# field -> the field it follows: chapters from the bank at a fixed chapter size, the decay start from the
# steps, the placement from memory.enabled=False, the data order from the seed, the loss weight from the balance.
_IMPLIED = {"memory.num_chapters": "memory.num_tokens", "train.decay_start_step": "train.steps",
            "memory.placement": "memory.enabled", "data.seed": "seed", "memory.load_balance_coef": "memory.load_balance"}


@dataclasses.dataclass(eq=False)
class Point:
  """One run of a sweep: `overrides` as given to moc_jax.main, `config` what they resolve to."""
  name: str
  overrides: dict
  config: object


# ---- names and flags --------------------------------------------------------------------------------

def flag_value(value) -> str:
  """`value` as the text of `--config.x=` that ml_collections parses back to it (tuples as `(a, b)`)."""
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(map(flag_value, value)) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def config_flags(overrides: dict) -> list[str]:
  return [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()]


def run_name(overrides: dict) -> str:
  """Deterministic from the overrides, in their order: `k8-bank1040`, `dense-mlp224`; `base` if none.
  `memory.enabled=False` is `dense`; a field that follows another overridden one (_IMPLIED) is left out."""
  parts = []
  for key, value in overrides.items():
    if key == "memory.enabled" and value is False:
      parts.append("dense")
    elif _IMPLIED.get(key) not in overrides:
      text = re.sub(r"[^A-Za-z0-9.]+", "_", flag_value(value)).strip("_")
      parts.append(_TAGS.get(key, key.rsplit(".", 1)[-1]) + text)
  return "-".join(parts) or "base"


def default_name(spec: str, sweep: str) -> str:
  """`configs/moc.py:tiny`, `demo` -> `moc-tiny-demo`."""
  path, _, arg = spec.partition(":")
  return "-".join(p for p in (os.path.splitext(os.path.basename(path))[0], arg.replace(",", "_"), sweep) if p)


# ---- planning ---------------------------------------------------------------------------------------

def resolve(spec: str, overrides: dict):
  """The config moc_jax.main builds from `--config=spec` and the overrides' flags, with the same parser."""
  from absl import flags
  from ml_collections import config_flags as cf
  argv = ["moc_jax.main", f"--config={spec}", *config_flags(overrides)]
  values = flags.FlagValues()
  cf.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
  try:
    values(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:  # an unknown field or a bad value
    raise ConfigError(f"{spec} with {' '.join(argv[2:])}: {e}") from e
  return values.config


def plan(spec: str, sweep: str, extra: dict | None = None, only=None, base: dict | None = None) -> list[Point]:
  """The sweep's points, each resolved and validated (nothing compiled). `extra` overrides (e.g. from
  the command line) change the config the sweep is built from and apply to every point without entering
  its name; a field the sweep sets itself is refused. `base` overrides are the same, except that a point
  that sets the field keeps its own value (a harness's size: the `budget` sweep scales the steps it is
  given). `only` keeps the named points."""
  path = spec.partition(":")[0]
  module = config_module(path)
  if not hasattr(module, "get_sweep"):
    raise ConfigError(f"{path} defines no sweeps (get_sweep); configs/moc.py does")
  extra, base, points, seen = dict(extra or {}), dict(base or {}), [], {}
  try:
    overrides_list = module.get_sweep(sweep, resolve(spec, {**base, **extra}))
  except ValueError as e:  # an unknown sweep
    raise ConfigError(str(e)) from e
  for overrides in overrides_list:
    name = run_name(overrides)
    if name in seen:
      if seen[name] != overrides:
        raise ConfigError(f"sweep {sweep}: points {seen[name]} and {overrides} are both named {name!r}")
      continue  # the same run twice (e.g. one vanilla baseline for two MoC points)
    seen[name] = overrides
    clash = sorted(set(extra) & set(overrides))
    if clash:
      raise ConfigError(f"--config.{clash[0]} is set by sweep {sweep} itself (point {name})")
    if only is None or name in only:
      kept = {k: v for k, v in base.items() if k not in overrides}
      points.append(Point(name, {**kept, **overrides, **extra}, None))
  unknown = sorted(set(only or ()) - set(seen))
  if unknown:
    raise ConfigError(f"--only: no points {unknown} in sweep {sweep}; it has {sorted(seen)}")
  for p in points:
    p.config = resolve(spec, p.overrides)
    try:
      validate(p.config)
    except ConfigError as e:
      raise ConfigError(f"sweep {sweep}, point {p.name}: {e}") from e
  return points


def compute(config) -> dict:
  """Tokens and training FLOPs of a run: the estimator's model FLOPs per token (forward + backward, memory
  counted as read, no recompute; the MFU count) times the tokens of train.steps updates."""
  from moc_jax.flops import model_flops_per_token
  t = config.train
  tokens = t.steps * t.batch_size * t.grad_accum * config.data.seq_len
  per_token = model_flops_per_token(config)
  return {"tokens": tokens, "flops_per_token": per_token, "train_flops": per_token * tokens}


def is_moc(config) -> bool:
  return bool(config.memory.enabled and memory_layers(config))


def same_run(a, b) -> bool:
  """Whether two resolved configs train the same run, so that one's finished workdir stands for the other's.
  They must be equal but for two things no step reads: when they evaluate, while both evaluate only at step 0
  and at their end (train.eval_every ≥ train.steps), and, in a model without memory layers, the memory fields
  beyond memory.enabled and memory.placement. The same config and seed then give the same losses and the same
  final evaluation (tests/sweeps/test_same_run.py trains both sides)."""
  def key(config):
    c = config.to_dict()
    if c["train"]["eval_every"] >= c["train"]["steps"]:
      c["train"]["eval_every"] = "end"
    if not memory_layers(config):
      c["memory"] = {k: c["memory"][k] for k in ("enabled", "placement")}
    return c
  return key(a) == key(b)


# ---- run state --------------------------------------------------------------------------------------

def read_metrics(workdir: str) -> list[dict]:
  rows = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          pass  # a line cut by a kill
  except FileNotFoundError:
    pass
  return rows


def final_eval(workdir: str, steps: int) -> dict | None:
  """The validation row the training loop writes after its last step, if it got there."""
  rows = [r for r in read_metrics(workdir) if r.get("split") == "validation" and r.get("step") == steps]
  return rows[-1] if rows else None


def latest_checkpoint(workdir: str) -> int | None:
  """The newest finished Orbax step (an interrupted save leaves only a temporary directory)."""
  try:
    steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  except FileNotFoundError:
    return None
  return max(steps, default=None)


def finished(workdir: str, steps: int) -> bool:
  """Done: the last evaluation logged and, where checkpoints live here (not on a pod), the last checkpoint."""
  if final_eval(workdir, steps) is None:
    return False
  return not os.path.isdir(os.path.join(workdir, "checkpoints")) or latest_checkpoint(workdir) == steps


def read_manifest(sweep_dir: str) -> list[dict]:
  path = os.path.join(sweep_dir, MANIFEST)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_manifest(sweep_dir: str, entries) -> None:
  path = os.path.join(sweep_dir, MANIFEST)
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(e) + "\n" for e in entries)
  os.replace(path + ".tmp", path)


# ---- backends ---------------------------------------------------------------------------------------

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


# ---- launching --------------------------------------------------------------------------------------

class Launcher:
  """Runs the points that are not done, `parallel` at a time, keeping manifest.jsonl current.

  Ctrl-C sends SIGTERM to the running commands (moc_jax.main then saves a checkpoint and exits), marks
  them pending and starts nothing more; the same command later resumes them. `launch_dir`: see `commands`;
  `python_path`: directories put first on the runs' PYTHONPATH (launch/sweep.py: the repository, so an
  uninstalled checkout runs its own moc_jax)."""

  def __init__(self, sweep_dir, spec, sweep, points, backend="local", backend_args=(), out=None,
               launch_dir="launch", python_path=()):
    self.dir, self.points, self.backend, self.out = sweep_dir, points, backend, out or sys.stdout
    self.python_path = tuple(python_path)
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
          "returncode": old.get("returncode"), "wall_s": old.get("wall_s", 0.0), "attempts": old.get("attempts", 0),
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
    todo = [p.name for p in self.points if self.entries[p.name]["status"] != "done"]
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

  def _save(self):
    write_manifest(self.dir, [*self.entries.values(), *self.others])

  def _run_point(self, name):
    e = self.entries[name]
    with self.lock:
      if self.stopping:
        return
      e["status"] = "running"
      self._save()
    os.makedirs(e["workdir"], exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (*self.python_path, os.environ.get("PYTHONPATH")) if p)}
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


def run_to_completion(sweep_dir, spec, sweep, points, parallel, harness) -> None:
  """Runs `points` in sweep_dir until each is done (a stage of a harness such as moc_jax.retention; finished
  points are skipped and interrupted ones resume, as with launch/sweep.py), with the current directory first
  on the runs' PYTHONPATH. Stops the harness, naming what to look at, when any point did not finish."""
  counts = Launcher(sweep_dir, spec, sweep, points, python_path=(os.getcwd(),)).run(parallel)
  if counts.get("done", 0) != len(points):
    raise SystemExit(f"{harness}: {sweep} finished {counts.get('done', 0)} of {len(points)} runs ({counts}); "
                     f"see {sweep_dir}/{MANIFEST} and each run's {LOG}, then re-run the same command")
