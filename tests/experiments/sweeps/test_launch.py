"""launch/ scripts: the commands their --dry-run prints, and (with fake gcloud/srun/scontrol/python
on PATH) that running them executes exactly those commands with the arguments intact."""
import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TPU, SLURM, LOCAL = "launch/tpu_pod.sh", "launch/slurm_gpu.sbatch", "launch/local.sh"
TPU_OPTS = ["--name", "moc", "--zone", "us-east5-a"]
# Awkward arguments for moc_jax.main: a space, a single quote, a $ that must not expand, a glob.
TRICKY = ["--config=configs/moc.py:262k", "--workdir=runs/my run", "--config.name=it's $HOME", "--config.x=*"]


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "TPU_", "MOC_")) and k not in ("PYTHON", "XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(extra)
  return env


def sh(script, *args, env=None, timeout=30):
  return subprocess.run(["bash", script, *args], cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                        timeout=timeout)


def ok(script, *args, **kw):
  r = sh(script, *args, **kw)
  assert r.returncode == 0, r.stderr
  return r.stdout


def commands(out):
  """The printed commands, each split into words as a shell would; comment lines dropped."""
  return [shlex.split(line) for line in out.splitlines() if line.strip() and not line.startswith("#")]


def option(words, name):
  """Value of `name VALUE` or `name=VALUE` in words."""
  for i, w in enumerate(words):
    if w == name:
      return words[i + 1]
    if w.startswith(name + "="):
      return w[len(name) + 1:]
  raise AssertionError(f"{name} not in {words}")


def write_exe(path, text):
  path.write_text(textwrap.dedent(text).lstrip())
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return path


@pytest.fixture
def fake_python(tmp_path):
  """A `python` that prints its arguments and the launch-relevant environment as one JSON line;
  FAKE_FAIL=<process id> makes that process exit 3, and every other one then sleeps (to be killed)."""
  return str(write_exe(tmp_path / "fakepy", f"""
    #!{sys.executable}
    import json, os, sys, time
    env = {{k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}}
    print(json.dumps({{"argv": sys.argv[1:], "env": env}}), flush=True)
    fail = os.environ.get("FAKE_FAIL")
    if fail is not None:
      if "--process_id=" + fail in sys.argv:
        sys.exit(3)
      time.sleep(60)
    """))


# ---------------------------------------------------------------------------------------------------- all


@pytest.mark.parametrize("script", [TPU, SLURM, LOCAL])
def test_scripts_are_executable_valid_bash_with_help(script):
  assert os.access(ROOT / script, os.X_OK), f"chmod +x {script}"
  assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
  assert "Usage" in ok(script, "--help")


@pytest.mark.parametrize("script,args,message", [
    (TPU, ["create", "--zone", "z"], "--name"),
    (TPU, ["create", "--name", "n"], "--zone"),
    (TPU, TPU_OPTS, "missing command"),
    (TPU, ["setup", *TPU_OPTS], "--repo"),
    (TPU, ["logs", *TPU_OPTS], "--workdir"),
    (TPU, ["run", *TPU_OPTS], "after --"),
    (TPU, ["run", *TPU_OPTS, "--zonee", "x", "--", "a"], "--zonee"),
    (TPU, ["create", *TPU_OPTS, "--name"], "--name needs a value"),
    (SLURM, ["--dry-run", "--", "--config=c"], "--nodelist"),
    (SLURM, ["--dry-run", "--nodes", "3", "--nodelist", "a,b", "--", "x"], "--nodes"),
    (SLURM, ["--", "--config=c"], "not inside a SLURM job"),
    (SLURM, ["--dry-run", "--nodelist", "a"], "after --"),
    (LOCAL, ["--dry-run"], "after --"),
    (LOCAL, ["--processes", "two", "--", "x"], "--processes"),
    (LOCAL, ["--port"], "--port needs a value"),
])
def test_bad_or_missing_options_fail_naming_the_option(script, args, message):
  r = sh(script, *args)
  assert r.returncode != 0
  assert message in r.stderr
  assert r.stdout == ""


# ---------------------------------------------------------------------------------------------------- tpu


def test_tpu_create_and_delete():
  [create] = commands(ok(TPU, "create", *TPU_OPTS, "--dry-run"))
  assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "moc"]
  assert option(create, "--zone") == "us-east5-a"
  assert option(create, "--accelerator-type") == "v5p-64"
  assert option(create, "--version") == "v2-alpha-tpuv5"
  assert not any(w.startswith("--project") for w in create)

  env = _env(TPU_NAME="other", TPU_ZONE="europe-west4-b", TPU_PROJECT="proj")
  [create] = commands(ok(TPU, "create", "--dry-run", "--accelerator=v5p-128", env=env))
  assert create[5] == "other" and option(create, "--zone") == "europe-west4-b"
  assert option(create, "--project") == "proj" and option(create, "--accelerator-type") == "v5p-128"

  [delete] = commands(ok(TPU, "delete", *TPU_OPTS, "--dry-run"))
  assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "moc"]
  assert "--quiet" in delete and option(delete, "--zone") == "us-east5-a"


def test_tpu_setup_clones_the_ref_on_all_workers():
  [setup] = commands(ok(TPU, "setup", *TPU_OPTS, "--repo", "https://example.com/moc.git", "--ref", "v1.2",
                        "--dir", "code", "--dry-run"))
  assert setup[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "moc"]
  assert "--worker=all" in setup
  remote = option(setup, "--command")
  assert "git clone https://example.com/moc.git code" in remote
  assert "git fetch origin v1.2" in remote and "cd code" in remote and remote.endswith("make venv")
  # make venv installs the libtpu the lock pins beside jax (on Linux x86-64, as the TPU VMs are)
  lock = (ROOT / "requirements.lock").read_text()
  assert 'libtpu==' in lock and 'platform_machine == "x86_64"' in lock.split("libtpu==")[1].splitlines()[0]


def _main_args(remote):
  """The arguments after `moc_jax.main` in a run's remote command, up to its redirection."""
  rest = shlex.split(remote)
  rest = rest[rest.index("moc_jax.main") + 1:]
  return rest[:next(i for i, w in enumerate(rest) if w in ("2>&1", ">>"))]


def test_tpu_run_passes_main_args_through_quoted(tmp_path, fake_python):
  [run] = commands(ok(TPU, "run", *TPU_OPTS, "--dir", str(tmp_path), "--dry-run", "--", *TRICKY))
  assert run[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "moc"]
  assert "--worker=all" in run and option(run, "--zone") == "us-east5-a"
  remote = option(run, "--command")
  assert shlex.split(remote)[:8] == ["cd", str(tmp_path), "&&", "mkdir", "-p", "logs", "&&", "set"]
  assert _main_args(remote) == ["--distributed", *TRICKY]
  # What the workers' shell does with it: run it against a fake .venv/bin/python. Its output reaches the
  # terminal and the worker's log, named by the workdir and the host.
  (tmp_path / ".venv/bin").mkdir(parents=True)
  os.symlink(fake_python, tmp_path / ".venv/bin/python")
  r = subprocess.run(["bash", "-c", remote], capture_output=True, text=True, env=_env(), check=True)
  assert json.loads(r.stdout)["argv"] == ["-m", "moc_jax.main", "--distributed", *TRICKY]
  host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
  assert (tmp_path / "logs" / f"my run.{host}.log").read_text() == r.stdout
  # a second run of the same workdir (a resume) adds to its log, never replaces it
  subprocess.run(["bash", "-c", remote], capture_output=True, text=True, env=_env(), check=True)
  assert (tmp_path / "logs" / f"my run.{host}.log").read_text() == 2 * r.stdout


def test_tpu_run_detached_outlives_the_session(tmp_path, fake_python):
  """--detach starts every worker's run in a session of its own, output to its log only, and returns."""
  [run] = commands(ok(TPU, "run", *TPU_OPTS, "--dir", str(tmp_path), "--detach", "--dry-run", "--", *TRICKY))
  remote = option(run, "--command")
  assert "nohup setsid .venv/bin/python" in remote and _main_args(remote) == ["--distributed", *TRICKY]
  (tmp_path / ".venv/bin").mkdir(parents=True)
  os.symlink(fake_python, tmp_path / ".venv/bin/python")
  r = subprocess.run(["bash", "-c", remote], capture_output=True, text=True, env=_env(), check=True)
  host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
  assert r.stdout.strip() == f"{host}: started"
  log = tmp_path / "logs" / f"my run.{host}.log"
  for _ in range(100):  # the background run writes it shortly
    if log.exists() and log.read_text():
      break
    time.sleep(0.05)
  assert json.loads(log.read_text())["argv"] == ["-m", "moc_jax.main", "--distributed", *TRICKY]
  r = sh(TPU, "logs", *TPU_OPTS, "--detach", "--workdir", "w", "--dry-run")
  assert r.returncode == 2 and "only run takes --detach" in r.stderr


def test_tpu_stop_signals_every_workers_run():
  [stop] = commands(ok(TPU, "stop", *TPU_OPTS, "--dry-run"))
  assert stop[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "moc"] and "--worker=all" in stop
  assert option(stop, "--command").startswith("pkill -TERM -f 'python -m moc_jax.main'")


def test_tpu_run_adds_workdir_only_when_missing():
  def main_args(*args):
    [run] = commands(ok(TPU, "run", *TPU_OPTS, "--workdir", "runs/a", "--dry-run", "--", *args))
    return _main_args(option(run, "--command"))[1:]

  assert main_args("--config=c") == ["--config=c", "--workdir=runs/a"]
  assert main_args("--config=c", "--workdir=runs/b") == ["--config=c", "--workdir=runs/b"]
  assert main_args("--config=c", "--workdir", "runs/b") == ["--config=c", "--workdir", "runs/b"]


def test_tpu_logs_copies_from_worker_0():
  mkdir, scp = commands(ok(TPU, "logs", *TPU_OPTS, "--workdir", "runs/262k", "--local_dir", "out", "--dry-run"))
  assert mkdir == ["mkdir", "-p", "out/262k"]
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  assert "--worker=0" in scp and "--recurse" in scp and option(scp, "--zone") == "us-east5-a"
  sources = [w for w in scp if w.startswith("moc:")]
  assert "moc:moc_jax/runs/262k/metrics.jsonl" in sources and "moc:moc_jax/runs/262k/config.json" in sources
  assert "moc:moc_jax/logs/262k.*.log" in sources  # worker 0's log of the run
  assert not any("checkpoints" in s for s in sources)
  assert scp[scp.index(sources[-1]) + 1] == "out/262k/"
  # An absolute workdir is used as it is.
  _, scp = commands(ok(TPU, "logs", *TPU_OPTS, "--workdir", "/data/r1", "--dry-run"))
  assert "moc:/data/r1/metrics.jsonl" in scp and "tpu_logs/r1/" in scp


@pytest.mark.parametrize("cmd,args", [
    ("create", []), ("setup", ["--repo", "u"]), ("run", ["--", *TRICKY]), ("logs", ["--workdir", "w"]),
    ("stop", []), ("delete", []),
])
def test_tpu_runs_what_dry_run_prints(tmp_path, cmd, args):
  """Without --dry-run the script calls gcloud (here a fake that records its argv) with exactly the printed words."""
  write_exe(tmp_path / "gcloud", f"""
    #!{sys.executable}
    import json, sys
    with open({str(tmp_path / "calls")!r}, "a") as f:
      f.write(json.dumps(sys.argv[1:]) + "\\n")
    """)
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}", MOC_LOCAL_DIR=str(tmp_path / "logs"))
  printed = [c for c in commands(ok(TPU, cmd, *TPU_OPTS, "--dry-run", *args, env=env)) if c[0] == "gcloud"]
  ok(TPU, cmd, *TPU_OPTS, *args, env=env)
  called = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
  assert [["gcloud", *c] for c in called] == printed


# ---------------------------------------------------------------------------------------------------- slurm


def test_slurm_header_asks_for_one_task_per_gpu():
  header = [line.split()[1] for line in (ROOT / SLURM).read_text().splitlines() if line.startswith("#SBATCH")]
  assert {"--ntasks-per-node=8", "--gpus-per-node=8"} <= set(header)
  assert {h.split("=")[0] for h in header} >= {"--nodes", "--cpus-per-task", "--time", "--job-name", "--output"}


def test_slurm_dry_run_prints_sbatch_coordinator_and_srun():
  out = ok(SLURM, "--dry-run", "--nodelist", "nodeA,nodeB", "--", *TRICKY)
  assert "coordinator: nodeA:12355" in out
  sbatch, srun = commands(out)
  assert sbatch[:3] == ["sbatch", "--nodes=2", SLURM] and sbatch[3:] == ["--", *TRICKY]
  assert srun[0] == "srun" and srun[srun.index("bash") + 1] == "-c"
  task_script = srun[srun.index("-c") + 1]
  assert "--process_id=$SLURM_PROCID" in task_script and "CUDA_VISIBLE_DEVICES=$SLURM_LOCALID" in task_script
  main = srun[srun.index("-m") - 1:]
  assert main[1:] == ["-m", "moc_jax.main", "--coordinator_address=nodeA:12355", "--num_processes=16", *TRICKY]


def test_slurm_dry_run_node_list_from_environment_and_port_override():
  out = ok(SLURM, "--dry-run", "--nodes", "3", "--", "--config=c",
           env=_env(SLURM_JOB_NODELIST="gpu7,gpu8,gpu9", MOC_PORT="2222", PATH="/usr/bin:/bin"))
  sbatch, srun = commands(out)
  assert "--coordinator_address=gpu7:2222" in srun and "--num_processes=24" in srun
  assert sbatch[:5] == ["sbatch", "--nodes=3", SLURM, "--port", "2222"]
  out = ok(SLURM, "--dry-run", "--nodelist=a,b,c,d", "--port", "4000", "--", "x")
  assert "--coordinator_address=a:4000" in commands(out)[1] and "--num_processes=32" in commands(out)[1]


def test_slurm_job_gives_each_task_its_process_id_and_gpu(tmp_path, fake_python):
  """Inside a (faked) allocation: scontrol expands the node list, srun runs the task command once per
  task with that task's SLURM_PROCID/SLURM_LOCALID, as the real one does."""
  write_exe(tmp_path / "scontrol", """
    #!/bin/bash
    [ "$1 $2" = "show hostnames" ] && tr , '\\n' <<<"$3"
    """)
  write_exe(tmp_path / "srun", """
    #!/bin/bash
    while [[ $1 == --* ]]; do shift; done
    for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$((i % 8)) "$@" || exit; done
    """)
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}", PYTHON=fake_python, SLURM_JOB_NODELIST="nodeA,nodeB",
             SLURM_NTASKS="16", SLURM_JOB_ID="1")
  runs = [json.loads(line) for line in ok(SLURM, "--", *TRICKY, env=env).splitlines()]
  assert len(runs) == 16
  for i, run in enumerate(runs):
    argv = run["argv"]
    assert argv[:2] == ["-m", "moc_jax.main"] and argv[-1] == f"--process_id={i}"
    assert "--coordinator_address=nodeA:12355" in argv and "--num_processes=16" in argv
    assert [a for a in argv if a in TRICKY] == TRICKY
    assert run["env"]["CUDA_VISIBLE_DEVICES"] == str(i % 8)


# ---------------------------------------------------------------------------------------------------- local


def test_local_single_process_is_one_plain_command():
  [cmd] = commands(ok(LOCAL, "--dry-run", "--", *TRICKY, env=_env(PYTHON="python3")))
  assert cmd == ["python3", "-m", "moc_jax.main", *TRICKY]


def test_local_multi_process_dry_run():
  out = ok(LOCAL, "--dry-run", "--processes", "2", "--devices_per_process", "4", "--", *TRICKY,
           env=_env(PYTHON="python3"))
  cmds = [c for c in commands(out) if "moc_jax.main" in c]
  assert len(cmds) == 2
  for i, cmd in enumerate(cmds):
    assert cmd[:2] == ["XLA_FLAGS=--xla_force_host_platform_device_count=4", "JAX_PLATFORMS=cpu"]
    assert cmd[2:5] == ["python3", "-m", "moc_jax.main"]
    assert cmd[5:5 + len(TRICKY)] == TRICKY
    assert cmd[5 + len(TRICKY):] == ["--coordinator_address=localhost:12355", "--num_processes=2",
                                     f"--process_id={i}", ">", f"runs/my run/process_{i}.log", "2>&1", "&"]
  # No workdir: logs go to /tmp; --port moves the coordinator.
  out = ok(LOCAL, "--dry-run", "--processes=3", "--port", "9999", "--", "--config=c")
  cmds = [c for c in commands(out) if "moc_jax.main" in c]
  assert [c[c.index(">") + 1] for c in cmds] == [f"/tmp/process_{i}.log" for i in range(3)]
  assert all("--coordinator_address=localhost:9999" in c for c in cmds)


def test_local_runs_processes_and_logs_each(tmp_path, fake_python):
  workdir = tmp_path / "run dir"
  ok(LOCAL, "--processes", "2", "--devices_per_process", "2", "--", f"--workdir={workdir}", "--config.n=a b",
     env=_env(PYTHON=fake_python))
  for i in range(2):
    run = json.loads((workdir / f"process_{i}.log").read_text())
    assert run["argv"] == ["-m", "moc_jax.main", f"--workdir={workdir}", "--config.n=a b",
                           "--coordinator_address=localhost:12355", "--num_processes=2", f"--process_id={i}"]
    assert run["env"] == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
                          "CUDA_VISIBLE_DEVICES": None}
  # One process: run directly, output on the console.
  run = json.loads(ok(LOCAL, "--", "--config=c", env=_env(PYTHON=fake_python)))
  assert run["argv"] == ["-m", "moc_jax.main", "--config=c"] and run["env"]["XLA_FLAGS"] is None


def test_local_failed_process_fails_the_launch_and_stops_the_rest(tmp_path, fake_python):
  r = sh(LOCAL, "--processes", "3", "--", f"--workdir={tmp_path}", env=_env(PYTHON=fake_python, FAKE_FAIL="1"),
         timeout=20)  # the other two sleep 60 s unless stopped
  assert r.returncode != 0
  assert "process 1 failed (exit 3)" in r.stderr
