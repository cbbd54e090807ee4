"""`python -m moc_jax.bench.cpu_peak [--dtype float32|bfloat16] [--force]`: the CPU peak MFU is reported
against (moc_jax/train/peaks.py measures and caches it), as one JSON line (both dtypes unless --dtype).
"""
from __future__ import annotations

import argparse
import json
import os

import jax

from moc_jax.train.peaks import DTYPES, cache_path, cpu_model, peak


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", choices=DTYPES, help="one dtype (default: both)")
  parser.add_argument("--force", action="store_true", help="re-measure even if cached")
  args = parser.parse_args(argv)
  records = {d: peak(d, force=args.force) for d in ([args.dtype] if args.dtype else DTYPES)}
  result = {"name": "cpu_peak", "cache": cache_path(),
            **{d: {"gflops_per_s": r["flops_per_s"] / 1e9,
                   "per_size_gflops_per_s": {n: v / 1e9 for n, v in r["per_size_flops_per_s"].items()}}
               for d, r in records.items()},
            "cpu": cpu_model(), "cores": os.cpu_count(), "jax": jax.__version__}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
