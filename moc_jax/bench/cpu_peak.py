"""Measured dense-matmul throughput of this CPU: the peak CPU MFU is reported against.

A CPU has no reliable datasheet peak (clock, SIMD width and XLA's matmul kernels all vary), so the
peak is what a saturating jitted matmul achieves here: square n x n products for n in `SIZES`, best
of `REPS` timed calls, in the dtype the model computes in. bf16 mirrors the model's dense layers
(bf16 operands, bf16 result, XLA accumulating internally). Measured once and cached under
$MOC_JAX_CACHE_DIR (default ~/.cache/moc_jax), keyed by CPU model, jax version, dtype and device count.

`python -m moc_jax.bench.cpu_peak [--dtype float32|bfloat16] [--force]` prints one JSON line
(both dtypes unless --dtype is given).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

SIZES = (1024, 2048, 4096)
REPS = 3
DTYPES = ("float32", "bfloat16")


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cache_path() -> str:
  root = os.environ.get("MOC_JAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moc_jax")
  return os.path.join(root, "cpu_peak.json")


def cache_key(dtype: str) -> str:
  return f"{cpu_model()} | jax {jax.__version__} | {dtype} | {jax.device_count()} device(s)"


def measure(dtype: str, sizes=SIZES, reps=REPS) -> dict:
  """Best matmul FLOP/s over sizes and repetitions (the first call of each size compiles, untimed)."""
  matmul = jax.jit(jnp.matmul)
  per_size = {}
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
      t0 = time.perf_counter()
      matmul(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    per_size[str(n)] = 2 * n**3 / best
  return {"dtype": dtype, "flops_per_s": max(per_size.values()), "per_size_flops_per_s": per_size,
          "cpu": cpu_model(), "cores": os.cpu_count(), "jax": jax.__version__,
          "devices": jax.device_count(), "reps": reps}


def _read() -> dict:
  try:
    with open(cache_path()) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def peak(dtype: str = "bfloat16", force: bool = False, **measure_kwargs) -> dict:
  """The cached record for this machine and dtype, measuring (and caching) it if absent or forced."""
  cache = _read()
  key = cache_key(dtype)
  if force or key not in cache:
    cache[key] = measure(dtype, **measure_kwargs)
    os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
    tmp = f"{cache_path()}.{os.getpid()}.tmp"  # processes measuring at once must not share it
    with open(tmp, "w") as f:
      json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(tmp, cache_path())
  return cache[key]


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
