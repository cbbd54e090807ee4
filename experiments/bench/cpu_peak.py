"""`python -m experiments.bench.cpu_peak [--dtype float32|bfloat16] [--force]`: the CPU peak MFU is reported
against (moc_jax/train/peaks.py measures and caches it), as one JSON line (both dtypes unless --dtype).
"""
from __future__ import annotations

import json
import os

import jax
from absl import flags

from moc_jax import cli
from moc_jax.train.peaks import DTYPES, cache_path, cpu_model, peak

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_enum("dtype", None, DTYPES, "one dtype (default: both)", flag_values=_FLAGS)
flags.DEFINE_bool("force", False, "re-measure even if cached", flag_values=_FLAGS)


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
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
