"""Peak dense-matmul FLOP/s per device: the denominator of MFU.

Accelerators use vendor bf16 dense peaks (no sparsity). A CPU has no trustworthy datasheet number (clock,
SIMD width and XLA's matmul kernels all vary), so its peak is what a saturating jitted matmul achieves on
this machine: square n x n products for n in `SIZES`, best of `REPS` timed calls, in the dtype the model
computes in (bf16 mirrors the model's dense layers: bf16 operands and result, XLA accumulating internally).
Measured once and cached under $MOC_JAX_CACHE_DIR (default ~/.cache/moc_jax), keyed by CPU model, jax
version, dtype and device count; `python -m experiments.bench.cpu_peak` prints or re-measures it.
An unknown device, or a dtype the table does not cover, yields (None, reason): MFU is then omitted
rather than computed against an invented peak.
"""
from __future__ import annotations

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


# (substring of the lower-cased device_kind, bf16 dense FLOP/s, name); first match wins, so the
# specific kinds come before the generic ones ("v5 lite" before "v5", "h100 pcie" before "h100").
ACCELERATORS = (
    ("v5 lite", 197e12, "TPU v5e"),
    ("v5e", 197e12, "TPU v5e"),
    ("v5p", 459e12, "TPU v5p"),
    ("v5", 459e12, "TPU v5p"),
    ("v6 lite", 918e12, "TPU v6e"),
    ("v6e", 918e12, "TPU v6e"),
    ("v4", 275e12, "TPU v4"),
    ("h100 pcie", 756e12, "H100 PCIe"),
    ("h100", 989e12, "H100 SXM"),
    ("h200", 989e12, "H200"),
)


def table_peak(device_kind: str, dtype: str = "bfloat16") -> tuple[float | None, str]:
  """The table's peak for a device kind; only bf16 is tabulated (other dtypes run at other rates)."""
  kind = device_kind.lower()
  for key, peak, name in ACCELERATORS:
    if key in kind:
      if dtype != "bfloat16":
        return None, f"no {dtype} peak tabulated for {name} (bf16 dense only)"
      return peak, f"table: {name} bf16 dense"
  return None, f"unknown device kind {device_kind!r}: no peak, MFU omitted"


def device_peak_flops(dtype: str = "bfloat16") -> tuple[float | None, str]:
  """(peak FLOP/s of one device for matmuls in `dtype`, where the number comes from)."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    record = peak(dtype)
    return record["flops_per_s"], f"measured on {record['cpu']} ({cache_path()})"
  return table_peak(device.device_kind, dtype)
