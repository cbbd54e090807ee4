r"""Launches a sweep of configs/moc.py (experiments/sweeps/): one workdir per point under sweeps/<name>/,
manifest.jsonl, finished points skipped and interrupted ones resumed; then collects the results.

  python launch/sweep.py --config=configs/moc.py:tiny --sweep=topk_bank --backend=local [--parallel 2]
  python launch/sweep.py --config=configs/moc.py:262k --sweep=bank --backend=tpu_pod \
      --backend_args='--name moc --zone us-east5-a' --dry-run
  python launch/sweep.py --config=configs/moc.py:262k --sweep=topk --backend=slurm --backend_args=--nodes=4

Further `--config.<field>=<value>` flags apply to every point and to the config the sweep is built from
(e.g. `--config.train.steps=200`).
Run it from the repository root, as moc_jax.main.
"""
import argparse
import os
import shlex
import sys
import time

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(LAUNCH_DIR)
sys.path.insert(0, REPO)  # the studies beside moc_jax; an uninstalled checkout runs its own moc_jax
from experiments.sweeps import report  # noqa: E402
from experiments.sweeps.launch import BACKENDS, Launcher  # noqa: E402
from experiments.sweeps.plan import default_name, plan  # noqa: E402
from moc_jax.errors import ConfigError  # noqa: E402


def main(argv=None):
  description, examples = __doc__.split("\n\n", 1)
  parser = argparse.ArgumentParser(description=description, epilog=examples,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="config file and argument, e.g. configs/moc.py:tiny")
  parser.add_argument("--sweep", required=True, help="a sweep the config file defines, e.g. topk, bank, topk_bank, "
                      "iso_flop, demo")
  parser.add_argument("--backend", choices=BACKENDS, default="local")
  parser.add_argument("--backend_args", default="", help="options for launch/tpu_pod.sh (--name, --zone, ...) "
                      "or for sbatch (--nodes=N, ...), as one shell-quoted string")
  parser.add_argument("--parallel", type=int, default=1, help="points running at once")
  parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
  parser.add_argument("--root", default="sweeps", help="directory of sweeps")
  parser.add_argument("--name", help="the sweep's directory under --root (default: <config>-<arg>-<sweep>)")
  parser.add_argument("--only", help="comma-separated point names: launch only these")
  parser.add_argument("--report_dir", help="where collect writes the table and plots (default: the sweep's directory)")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
  if bad:
    parser.error(f"unrecognized arguments {bad} (only --config.<field>=<value> flags are passed on)")
  if args.parallel < 1:
    parser.error("--parallel must be >= 1")
  extra = dict(a[len("--config."):].split("=", 1) for a in rest)
  sweep_dir = os.path.join(args.root, args.name or default_name(args.config, args.sweep))
  try:
    points = plan(args.config, args.sweep, extra, args.only.split(",") if args.only else None)
    launcher = Launcher(sweep_dir, args.config, args.sweep, points, args.backend,
                        shlex.split(args.backend_args), launch_dir=LAUNCH_DIR, python_path=(REPO,))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.dry_run:
    launcher.describe()
    return 0
  t0 = time.time()
  counts = launcher.run(args.parallel)
  print(report.collect(sweep_dir, args.report_dir))
  print(f"sweep {sweep_dir}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f" ({time.time() - t0:.0f} s)")
  return 0 if set(counts) == {"done"} else 1


if __name__ == "__main__":
  sys.exit(main())
