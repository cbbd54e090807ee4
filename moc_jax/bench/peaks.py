"""Peak dense-matmul FLOP/s per device: the denominator of MFU.

Accelerators use vendor bf16 dense peaks (no sparsity). A CPU has no trustworthy datasheet number, so
its peak is the jitted-matmul throughput measured on this machine (`moc_jax.bench.cpu_peak`, cached).
An unknown device, or a dtype the table does not cover, yields (None, reason): MFU is then omitted
rather than computed against an invented peak.
"""
from __future__ import annotations

import jax

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
    from moc_jax.bench import cpu_peak
    record = cpu_peak.peak(dtype)
    return record["flops_per_s"], f"measured on {record['cpu']} ({cpu_peak.cache_path()})"
  return table_peak(device.device_kind, dtype)
