"""Collects a sweep (experiments/sweeps/report.py): results.csv, results.md and loss_vs_*.png, the table printed.

  python launch/collect.py sweeps/moc-tiny-demo [--out docs/sweeps]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the studies beside moc_jax
from experiments.sweeps import report  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("sweep_dir", help="a directory launch/sweep.py wrote (it holds manifest.jsonl)")
  parser.add_argument("--out", help="where to write the table and plots (default: sweep_dir)")
  args = parser.parse_args(argv)
  try:
    print(report.collect(args.sweep_dir, args.out), end="")
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
