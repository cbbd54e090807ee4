"""Sweeps (configs/moc.py get_sweep, experiments/sweeps/plan.py, launch/sweep.py): every point of every sweep valid
for every model, overrides applied as moc_jax.main's flags, names, iso-FLOP baselines, the commands each
backend's --dry-run prints (checked against the launch scripts' own --dry-run), and idempotent re-launch."""
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import moc_jax
from experiments.sweeps import launch
from experiments.sweeps.launch import Launcher
from experiments.sweeps.plan import config_flags, default_name, is_moc, plan, resolve, run_name
from experiments.sweeps.runs import LOG, final_eval, finished, latest_checkpoint, read_manifest
from moc_jax import flops
from moc_jax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
MODELS = ("tiny", "small", "262k", "tiny,runlocal")
SWEEP_NAMES = ("topk", "bank", "topk_bank", "iso_flop", "demo")


def _cli():
  spec = importlib.util.spec_from_file_location("sweep_cli", ROOT / "launch" / "sweep.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def dry_run(capsys, *args):
  assert _cli().main([*args, "--dry-run"]) == 0
  out = capsys.readouterr().out
  return out, [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]


@pytest.mark.parametrize("model", MODELS)
def test_every_point_of_every_sweep_validates(model):
  for sweep in SWEEP_NAMES:
    points = plan(f"configs/moc.py:{model}", sweep)  # resolves and validates each: raises otherwise
    assert len({p.name for p in points}) == len(points) >= 3, (model, sweep)
    for p in points:
      mem = p.config.memory
      assert mem.top_k <= mem.num_chapters - mem.num_shared and mem.num_tokens % mem.num_chapters == 0


def test_sweeps_scale_with_the_model():
  def values(model, sweep, key):
    return [p.overrides[key] for p in plan(f"configs/moc.py:{model}", sweep)]

  for model in ("tiny", "262k"):
    assert values(model, "topk", "memory.top_k") == [1, 2, 4, 8, 16, 32, 64]
  # The paper's bank range at its k·T = 64·64 read; tiny's at 8·16.
  assert values("262k", "bank", "memory.num_tokens") == [4160, 8256, 16448, 32832, 65600, 131136, 262208]
  assert values("tiny", "bank", "memory.num_tokens") == [144, 272, 528, 1040]
  assert len(plan("configs/moc.py:262k", "topk_bank")) == 49
  tiny = plan("configs/moc.py:tiny", "topk_bank")
  assert len(tiny) == 4 + 5 + 6 + 7 and "k8-bank144" in {p.name for p in tiny}  # k <= routable chapters
  demo = plan("configs/moc.py:tiny", "demo")
  assert [p.name for p in demo][:3] == ["bank144-steps56", "bank144-steps112", "bank144-steps225"]
  assert len(demo) == 12 and [p.name for p in demo][-3:] == ["dense-steps56", "dense-steps112", "dense-steps225"]
  assert not demo[-1].config.memory.enabled
  # bank_scale: the config's routable chapters x 1, 4, 16, 64 at the same read, seed by seed.
  scale = plan("configs/moc.py:tiny", "bank_scale")
  assert [p.name for p in scale][:4] == ["bank1040-seed0", "bank4112-seed0", "bank16400-seed0", "bank65552-seed0"]
  assert len(scale) == 12 and {(p.config.memory.top_k, p.config.memory.num_tokens // p.config.memory.num_chapters)
                               for p in scale} == {(8, 16)}
  assert values("262k", "bank_scale", "memory.num_chapters")[:4] == [4097, 16385, 65537, 262145]
  # bank_lr: 0, 0.01x, 0.1x, 1x, 10x the memory LR, seed by seed.
  bank_lr = plan("configs/moc.py:tiny", "bank_lr")
  assert [p.name for p in bank_lr][:6] == ["banklr0.0-seed0", "banklr3e_05-seed0", "banklr0.0003-seed0",
                                           "banklr0.003-seed0", "banklr0.03-seed0", "banklr0.0-seed1"]
  assert len(bank_lr) == 15 and {p.config.train.bank_weight_decay for p in bank_lr} == {None}
  assert values("262k", "bank_lr", "train.bank_lr")[:5] == [0.0, 6e-6, 6e-5, 6e-4, 6e-3]
  # The paper model's demo scales the decay start with the steps.
  assert plan("configs/moc.py:262k", "demo")[0].config.train.decay_start_step == 8160 // 16


def test_overrides_resolve_exactly_as_load_config():
  overrides = {"memory.layer_indices": (3,), "memory.routing": "token", "train.base_lr": 1e-3,
               "memory.enabled": True, "model.mlp_dim": 256, "memory.routed_scaling_factor": 2.0}
  resolved = resolve("configs/moc.py:tiny", overrides)
  assert resolved.to_dict() == moc_jax.load_config("configs/moc.py:tiny", overrides).to_dict()
  assert config_flags(overrides)[:3] == ["--config.memory.layer_indices=(3,)",
                                                "--config.memory.routing=token", "--config.train.base_lr=0.001"]
  with pytest.raises(ConfigError, match="memory.no_such_field"):
    resolve("configs/moc.py:tiny", {"memory.no_such_field": 1})


def test_run_names():
  assert run_name({"memory.top_k": 8, "memory.num_chapters": 65, "memory.num_tokens": 1040}) == "k8-bank1040"
  assert run_name({"memory.enabled": False, "memory.placement": "none", "model.mlp_dim": 224}) == "dense-mlp224"
  assert run_name({"train.steps": 56, "train.decay_start_step": 40}) == "steps56"
  assert run_name({"memory.layer_indices": (1, 3), "train.base_lr": 0.003}) == "layer_indices1_3-base_lr0.003"
  assert run_name({}) == "base"
  assert run_name({"memory.load_balance": "aux_free", "memory.routing": "segment",
                          "memory.load_balance_coef": 0.0, "seed": 2, "data.seed": 2}) == "aux_free-segment-seed2"
  assert default_name("configs/moc.py:tiny,runlocal", "topk") == "moc-tiny_runlocal-topk"


def test_routing_sweep_arms():
  """The backbone, its iso-FLOP vanilla, MoC under 3 balances x 3 routings and the attention-pooled causal arm,
  3 seeds each; the pooled arm resolves to routed + prefix + attention."""
  points = plan("configs/moc.py:tiny", "routing")
  assert len(points) == 12 * 3 and len({p.name for p in points}) == 36
  pooled = [p for p in points if p.name == "routed-prefix-attention-seed1"]
  assert len(pooled) == 1
  mem = pooled[0].config.memory
  assert (mem.load_balance, mem.routing, mem.routing_pool, pooled[0].config.seed) == ("routed", "prefix", "attention", 1)
  assert sum(p.config.memory.routing_pool == "attention" for p in points) == 3


def test_cluster_sweep_arms():
  """The learned router, cluster routing over the same routable chapters (tiny: 4·4 + 3·16 = 64), the same with the
  generic control (1/(k+1), 7 more chapters of 16 tokens), the router within the subtree (the same layout), FFN
  memory on the same tree (the bank's 66,560
  parameters are 346 columns of 3 x 64: 346 // 8 = 43 per level-0 node, 346 // 32 = 10 per leaf, 4·43 + 16·10 = 332)
  and the iso-FLOP dense model, 3 seeds each."""
  points = plan("configs/moc.py:tiny", "cluster")
  assert len(points) == 6 * 3 and len({p.name for p in points}) == 18
  seed0 = [p.config for p in points if p.config.seed == 0]
  learned, cluster, generic, subtree, ffn, dense = seed0
  assert (subtree.memory.routing, tuple(subtree.memory.cluster_chapters), subtree.memory.top_k) == (
      "subtree", (4, 3), 8)
  assert (ffn.memory.kind, ffn.memory.routing, tuple(ffn.memory.cluster_chapters)) == ("ffn", "cluster", (43, 10))
  assert (ffn.memory.num_chapters, ffn.memory.num_shared) == (332, 0)
  assert learned.memory.routing == "prefix" and not dense.memory.enabled
  for c in (cluster, generic):
    assert (c.memory.routing, c.data.cluster.k, tuple(c.memory.cluster_chapters)) == ("cluster", 4, (4, 3))
  assert cluster.memory.num_chapters == 65 and cluster.data.cluster.generic == 0
  assert (generic.memory.num_chapters, generic.memory.num_tokens, generic.data.cluster.generic) == (72, 1152, 0.2)


@pytest.mark.parametrize("model", ["tiny", "small", "262k"])
def test_iso_flop_vanilla_is_the_closest_width(model):
  """Each MoC point's vanilla is in the sweep at the multiple of 16 whose FLOPs/token are nearest the MoC point's,
  found here by search; the sweep holds no other vanilla (top-ks whose nearest width is the same share one run)."""
  points = plan(f"configs/moc.py:{model}", "iso_flop")
  backbone = points[0].config
  assert points[0].name == "dense" and not is_moc(backbone)
  assert backbone.model.mlp_dim == moc_jax.load_config(f"configs/moc.py:{model}").model.mlp_dim
  mocs = [p for p in points if is_moc(p.config)]
  assert [m.name for m in mocs] == [f"k{k}" for k in (1, 2, 4, 8, 16, 32, 64)]
  widths = set()
  for moc in mocs:
    goal = flops.model_flops_per_token(moc.config)

    def miss(width, goal=goal):
      c = backbone.copy_and_resolve_references()
      c.model.mlp_dim = width
      return abs(flops.model_flops_per_token(c) / goal - 1)

    width = min(range(16, 16 * 1024, 16), key=miss)
    assert miss(width) < 0.02, (moc.name, width, miss(width))
    widths.add(width)
  vanillas = {p.name: p.config.model.mlp_dim for p in points[1:] if not is_moc(p.config)}
  assert vanillas == {f"dense-mlp{w}": w for w in widths}


def test_plan_extra_overrides_and_errors():
  with pytest.raises(ConfigError, match="unknown sweep"):
    plan("configs/moc.py:tiny", "nope")
  with pytest.raises(ConfigError, match="defines no sweeps"):
    plan("configs/vanilla.py:tiny", "topk")
  # Command-line overrides change the config the sweep is built from: banks from top-4 reads.
  assert [p.name for p in plan("configs/moc.py:tiny", "bank", {"memory.top_k": "4"})] == [
      "bank80", "bank144", "bank272", "bank528", "bank1040"]
  with pytest.raises(ConfigError, match="set by sweep topk itself"):
    plan("configs/moc.py:tiny", "topk", {"memory.top_k": "3"})
  with pytest.raises(ConfigError, match="no points"):
    plan("configs/moc.py:tiny", "topk", only=["k3"])


def test_plan_base_overrides_yield_to_the_points_own():
  # The budget sweep scales the steps it is given; a point that sets nothing keeps the base value.
  points = plan("configs/moc.py:tiny", "budget", {"memory.routing": "prefix"}, base={"train.steps": 80})
  assert sorted({p.config.train.steps for p in points}) == [40, 80, 160]
  assert all(p.config.memory.routing == "prefix" and "train.steps" not in p.name for p in points)
  assert {p.config.train.steps for p in plan("configs/moc.py:tiny", "bank", base={"train.steps": 80})} == {80}


# ---------------------------------------------------------------------------------------------------- dry runs

def test_local_dry_run(capsys, tmp_path):
  out, cmds = dry_run(capsys, "--config=configs/moc.py:tiny", "--sweep=topk", f"--root={tmp_path}",
                      "--config.name=my run")
  assert len(cmds) == 7 and out.count("model FLOPs/token") == 7
  workdir = tmp_path / "moc-tiny-topk" / "k4"
  assert cmds[2] == [sys.executable, "-m", "moc_jax.main", "--config=configs/moc.py:tiny", f"--workdir={workdir}",
                     "--config.memory.top_k=4", "--config.name=my run"]
  assert not (tmp_path / "moc-tiny-topk").exists()  # a dry run writes nothing


def test_tpu_pod_dry_run_goes_through_tpu_pod_sh(capsys, tmp_path):
  _, cmds = dry_run(capsys, "--config=configs/moc.py:262k", "--sweep=bank", "--backend=tpu_pod", f"--root={tmp_path}",
                    "--backend_args=--name moc --zone us-east5-a")
  assert len(cmds) == 2 * 7
  run, logs = cmds[:2]
  workdir = str(tmp_path / "moc-262k-bank" / "bank4160")
  main_args = ["--config=configs/moc.py:262k", f"--workdir={workdir}", "--config.memory.num_chapters=65",
               "--config.memory.num_tokens=4160"]
  assert run == ["launch/tpu_pod.sh", "run", "--name", "moc", "--zone", "us-east5-a", "--", *main_args]
  # The script accepts the line and runs moc_jax.main with exactly those arguments on every worker.
  printed = _script_dry_run(run[0], [run[1], "--dry-run", *run[2:]])
  remote = printed[0][printed[0].index("--command") + 1]
  assert "--worker=all" in printed[0]
  words = shlex.split(remote)
  start = words.index(".venv/bin/python")
  assert words[start:start + 4 + len(main_args)] == [".venv/bin/python", "-m", "moc_jax.main", "--distributed",
                                                      *main_args] and words[start + 4 + len(main_args)] == "2>&1"
  # logs copies the run's files into its local workdir.
  assert logs[:2] == ["launch/tpu_pod.sh", "logs"]
  mkdir, scp = _script_dry_run(logs[0], [logs[1], "--dry-run", *logs[2:]])
  sources = [w for w in scp if w.startswith("moc:")]
  assert mkdir == ["mkdir", "-p", workdir] and f"moc:{workdir}/metrics.jsonl" in sources
  assert scp[scp.index(sources[-1]) + 1] == workdir + "/"


def test_slurm_dry_run_goes_through_slurm_gpu_sbatch(capsys, tmp_path):
  _, cmds = dry_run(capsys, "--config=configs/moc.py:262k", "--sweep=topk", "--backend=slurm", f"--root={tmp_path}",
                    "--backend_args=--nodes=2 --time=4:00:00")
  assert len(cmds) == 7
  workdir = str(tmp_path / "moc-262k-topk" / "k64")
  main_args = ["--config=configs/moc.py:262k", f"--workdir={workdir}", "--config.memory.top_k=64"]
  assert cmds[-1] == ["sbatch", "--wait", f"--output={workdir}/slurm-%j.out", "--nodes=2", "--time=4:00:00",
                      "launch/slurm_gpu.sbatch", "--", *main_args]
  # What the job would run: the script's own dry run on two nodes.
  script = cmds[-1].index("launch/slurm_gpu.sbatch")
  _, srun = _script_dry_run(cmds[-1][script], ["--dry-run", "--nodelist", "a,b", *cmds[-1][script + 1:]])
  assert srun[srun.index("-m") + 1:] == ["moc_jax.main", "--coordinator_address=a:12355", "--num_processes=16",
                                         *main_args]


def _script_dry_run(script, args):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_", "MOC_"))}
  r = subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True)
  return [shlex.split(line) for line in r.stdout.splitlines() if line.strip() and not line.startswith("#")]


# ---------------------------------------------------------------------------------------------------- launching

FAKE_MAIN = textwrap.dedent("""
    import json, os, signal, sys, time
    workdir, steps = sys.argv[1], int(sys.argv[2])
    name = os.path.basename(workdir)
    with open(os.environ["CALLS"], "a") as f:
      f.write(name + "\\n")
    with open(os.environ["CALLS"] + ".cache", "a") as f:
      f.write(os.environ.get("JAX_COMPILATION_CACHE_DIR", "") + "\\n")
    if name in os.environ.get("FAIL", "").split(","):
      print("boom", file=sys.stderr)
      sys.exit(3)
    if name in os.environ.get("SLOW", "").split(","):  # stopped by SIGTERM, as moc_jax.main: exit 0, unfinished
      signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
      print("started", flush=True)
      time.sleep(60)
    os.makedirs(os.path.join(workdir, "checkpoints", str(steps)))
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps({"step": steps, "split": "validation", "ce": 1.0}) + "\\n")
    """)


@pytest.fixture
def fake_backend(tmp_path, monkeypatch):
  """The local backend with moc_jax.main replaced by a script that records its call and finishes the run
  (writes the last evaluation and checkpoint), or exits 3 for the points named in $FAIL, or waits for
  SIGTERM for those in $SLOW."""
  script = tmp_path / "fake_main.py"
  script.write_text(FAKE_MAIN)
  monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
  monkeypatch.setattr(launch, "commands", lambda backend, spec, point, workdir, backend_args, launch_dir: [
      [sys.executable, str(script), workdir, str(point.config.train.steps)]])
  return lambda: (tmp_path / "calls").read_text().split()


def test_launch_records_each_point_and_relaunch_skips_finished_ones(tmp_path, monkeypatch, fake_backend, capsys):
  spec, sweep_dir = "configs/moc.py:tiny", str(tmp_path / "sw")
  points = plan(spec, "topk", only=["k1", "k2", "k4"])
  # k4 was interrupted at step 300: it holds a checkpoint and no final evaluation.
  os.makedirs(os.path.join(sweep_dir, "k4", "checkpoints", "300"))
  monkeypatch.setenv("FAIL", "k2")
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  launcher = Launcher(sweep_dir, spec, "topk", points)
  launcher.describe()
  assert "# k4: moc" in capsys.readouterr().out.split("resumes from step 300")[0]
  assert launcher.run(parallel=2) == {"done": 2, "failed": 1}
  assert sorted(fake_backend()) == ["k1", "k2", "k4"]
  # the runs share one compilation cache in the sweep's directory
  assert (tmp_path / "calls.cache").read_text().split() == [os.path.join(sweep_dir, launch.COMPILATION_CACHE)] * 3
  manifest = {e["name"]: e for e in read_manifest(sweep_dir)}
  assert [manifest[n]["status"] for n in ("k1", "k2", "k4")] == ["done", "failed", "done"]
  assert manifest["k2"]["returncode"] == 3 and manifest["k1"]["returncode"] == 0
  assert manifest["k1"]["overrides"] == {"memory.top_k": 1} and manifest["k1"]["attempts"] == 1
  assert manifest["k1"]["wall_s"] >= 0 and manifest["k1"]["workdir"] == os.path.join(sweep_dir, "k1")
  assert "boom" in (Path(sweep_dir) / "k2" / LOG).read_text()
  # Re-launch: only the failed point runs again; its attempts accumulate.
  monkeypatch.setenv("FAIL", "")
  assert Launcher(sweep_dir, spec, "topk", points).run() == {"done": 3}
  assert sorted(fake_backend()) == ["k1", "k2", "k2", "k4"]
  manifest = {e["name"]: e for e in read_manifest(sweep_dir)}
  assert manifest["k2"]["attempts"] == 2 and manifest["k2"]["status"] == "done"
  # The same directory refuses another sweep.
  with pytest.raises(ConfigError, match="another --name"):
    Launcher(sweep_dir, spec, "bank", plan(spec, "bank"))


def test_a_killed_launch_keeps_its_runs_wall_time(tmp_path, fake_backend):
  """A launch killed outright (no Ctrl-C: SIGKILL, a lost machine) leaves its run `running` in the manifest; the
  next launch adds that attempt's time, from its start to its log's last write, to the run's wall time, and counts
  it: one attempt before it, the killed one, and the one that finishes."""
  spec, sweep_dir = "configs/moc.py:tiny", str(tmp_path / "sw")
  points = plan(spec, "topk", only=["k1"])
  os.makedirs(sweep_dir)
  killed = Launcher(sweep_dir, spec, "topk", points)
  started = time.time() - 1000
  killed.entries["k1"].update(status="running", started=started, wall_s=5.0, attempts=1)
  killed._save()
  log = Path(sweep_dir) / "k1" / LOG
  log.parent.mkdir(parents=True)
  log.write_text("step 100\n")
  os.utime(log, (started + 100, started + 100))
  assert Launcher(sweep_dir, spec, "topk", points).run() == {"done": 1}
  entry = read_manifest(sweep_dir)[0]
  assert 105.0 <= entry["wall_s"] < 105.0 + 60 and entry["attempts"] == 3 and "started" not in entry


def test_parallel_points_start_with_the_most_training_left(tmp_path):
  """One at a time the plan's order; several at once the most FLOPs left first: k4 reads the most but is a step
  from its end, k2 reads more than k1, and k8 is done."""
  spec, sweep_dir = "configs/moc.py:tiny", str(tmp_path / "sw")
  points = plan(spec, "topk", only=["k1", "k2", "k4", "k8"])
  steps = points[0].config.train.steps
  os.makedirs(os.path.join(sweep_dir, "k4", "checkpoints", str(steps - 1)))
  os.makedirs(os.path.join(sweep_dir, "k8", "checkpoints", str(steps)))
  with open(os.path.join(sweep_dir, "k8", "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": steps, "split": "validation", "ce": 1.0}) + "\n")
  launcher = Launcher(sweep_dir, spec, "topk", points)
  assert launcher.order(1) == ["k1", "k2", "k4"]
  assert launcher.order(2) == ["k2", "k1", "k4"]
  # the points named first start first, each group in its own order (k8, done, named or not, does not start)
  first = Launcher(sweep_dir, spec, "topk", points, first={"k4", "k1", "k8"})
  assert first.order(1) == ["k1", "k4", "k2"]
  assert first.order(2) == ["k1", "k4", "k2"]


def test_ctrl_c_stops_running_points_and_leaves_them_pending(tmp_path, monkeypatch, fake_backend, capsys):
  spec, sweep_dir = "configs/moc.py:tiny", str(tmp_path / "sw")
  monkeypatch.setenv("SLOW", "k1")
  launcher = Launcher(sweep_dir, spec, "topk", plan(spec, "topk", only=["k1", "k2"]))

  def interrupt_once_started():
    log = Path(sweep_dir) / "k1" / LOG
    while not (log.exists() and "started" in log.read_text()):
      time.sleep(0.05)
    signal.raise_signal(signal.SIGINT)  # Ctrl-C reaches the sweep (the point runs in its own session)

  # Ctrl-C as a terminal delivers it: Python's default handler (libraries imported by earlier tests in this
  # process may have replaced it)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  threading.Thread(target=interrupt_once_started, daemon=True).start()
  try:
    assert launcher.run() == {"pending": 2}
  finally:
    signal.signal(signal.SIGINT, previous)
  assert fake_backend() == ["k1"]  # k2 never started
  assert "interrupted" in capsys.readouterr().out
  manifest = {e["name"]: e for e in read_manifest(sweep_dir)}
  assert manifest["k1"]["attempts"] == 1 and manifest["k2"]["attempts"] == 0


LAUNCH_IN_BACKGROUND = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts `cmd &`
    from experiments.sweeps import launch
    from experiments.sweeps.plan import plan
    script, sweep_dir = sys.argv[1:]
    launch.commands = lambda backend, spec, point, workdir, *_: [
        [sys.executable, script, workdir, str(point.config.train.steps)]]
    spec = "configs/moc.py:tiny"
    launcher = launch.Launcher(sweep_dir, spec, "topk", plan(spec, "topk", only=["k1", "k2"]))
    print(launcher.run(), flush=True)
    """)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_backgrounded_sweep_stops_on_ctrl_c_or_sigterm(tmp_path, monkeypatch, fake_backend, signum):
  """Started as a shell starts `cmd &` (SIGINT ignored), the sweep still stops on SIGINT, and on SIGTERM,
  as on Ctrl-C: its running point is stopped at a checkpoint and left pending, the next one never starts."""
  sweep_dir = tmp_path / "sw"
  (tmp_path / "launch.py").write_text(LAUNCH_IN_BACKGROUND)
  monkeypatch.setenv("SLOW", "k1")
  monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the studies run from the repository, not an installed package
  proc = subprocess.Popen([sys.executable, str(tmp_path / "launch.py"), str(tmp_path / "fake_main.py"),
                           str(sweep_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  log, deadline = sweep_dir / "k1" / LOG, time.time() + 120
  while not (log.exists() and "started" in log.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  try:
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert "{'pending': 2}" in out
  assert fake_backend() == ["k1"]
  assert [e["status"] for e in read_manifest(str(sweep_dir))] == ["pending", "pending"]


def test_a_point_stopped_from_outside_is_left_pending(tmp_path, monkeypatch, fake_backend):
  """A run that exits 0 unfinished was stopped from outside (pre-empted; it saved a checkpoint): it is
  pending, to resume, not failed."""
  spec, sweep_dir = "configs/moc.py:tiny", str(tmp_path / "sw")
  monkeypatch.setenv("SLOW", "k1")
  launcher = Launcher(sweep_dir, spec, "topk", plan(spec, "topk", only=["k1"]))

  def preempt_once_started():
    log = Path(sweep_dir) / "k1" / LOG
    while not (log.exists() and "started" in log.read_text()):
      time.sleep(0.05)
    [proc] = launcher.procs
    proc.terminate()

  threading.Thread(target=preempt_once_started, daemon=True).start()
  assert launcher.run() == {"pending": 1}
  [entry] = read_manifest(sweep_dir)
  assert entry["returncode"] == 0 and entry["attempts"] == 1


def test_finished_needs_the_last_evaluation_and_checkpoint(tmp_path):
  workdir = str(tmp_path)
  rows = [{"step": 10, "loss": 1.0}, {"step": 10, "split": "validation", "ce": 2.0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
  assert final_eval(workdir, 10)["ce"] == 2.0 and final_eval(workdir, 20) is None
  assert finished(workdir, 10)  # logs copied from a pod: no checkpoints/ here
  os.makedirs(tmp_path / "checkpoints" / "5")
  os.makedirs(tmp_path / "checkpoints" / "10.orbax-checkpoint-tmp-1")  # a save cut by a kill
  assert not finished(workdir, 10) and latest_checkpoint(workdir) == 5
  os.makedirs(tmp_path / "checkpoints" / "10")
  assert finished(workdir, 10)


@pytest.mark.slow
def test_local_sweep_trains_and_collects(tmp_path):
  """Two real tiny points (3 steps each) through launch/sweep.py, then again: nothing re-runs."""
  args = [sys.executable, "launch/sweep.py", "--config=configs/moc.py:tiny,runlocal", "--sweep=topk",
          "--only=k1,k2", f"--root={tmp_path}", "--parallel=2"]
  r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout + r.stderr
  sweep_dir = tmp_path / "moc-tiny_runlocal-topk"
  assert [e["status"] for e in read_manifest(str(sweep_dir))] == ["done", "done"]
  assert (sweep_dir / "results.csv").exists() and "| k2 | done | moc | 2 |" in r.stdout
  r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert "2 of 2 points done, running 0" in r.stdout


def test_a_long_run_name_keeps_its_head_and_tail_around_a_digest():
  """Names past MAX_NAME (a directory name must stay under 255 bytes) keep 40 characters of head and the tail, where
  the knobs are, around a digest of the whole: unique, deterministic; short names are unchanged."""
  from experiments.sweeps.plan import MAX_NAME, run_name
  long = {f"data.facts.field{i}": i for i in range(30)}
  a, b = run_name({**long, "train.base_lr": 1e-4}), run_name({**long, "train.base_lr": 3e-4})
  assert len(a) == len(b) == MAX_NAME and a != b and a.endswith("base_lr0.0001") and a.startswith("field00-field11")
  assert a == run_name({**long, "train.base_lr": 1e-4})
  assert run_name({"memory.top_k": 8}) == "k8"
