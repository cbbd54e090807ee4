"""A TPU slice on a host without one: the compile-only devices of a topology (`v5e:4x4`, `v5p:4x4x4`) from the
installed libtpu (the `tpu` extra), their chip, and the HBM its compiler lets one program use.

Nothing runs on these devices. A step compiled for them goes through the TPU compiler itself (XLA's TPU backend,
Mosaic for the Pallas kernels), so whether it fits a chip's HBM is the compiler's verdict, not an estimate.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from moc_jax.errors import UsageError

INSTALL = 'pip install "moc_jax[tpu]" (libtpu, the version the pinned jax uses on TPUs)'
# The chips probed by `chips()`, as the topology names spell them.
CHIP_NAMES = ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x")
_OOM = re.compile(r"CompileTimeHbmOom.*?\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", re.DOTALL)
GIB = 1 << 30


def installed() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str:
  return importlib.metadata.version("libtpu")


def host_defaults():
  """On a host without a TPU chip: the environment libtpu reads when it loads, where unset. Without a TPU VM's
  metadata libtpu cannot tell its accelerator type or workers and prints warnings at every load (the type named
  here only quiets that: a compile-only topology is named on its own); and its multi-process lock, which keeps two
  processes off the same chips, would make a second process on this host fail to load it although there are no
  chips to share. A host with TPU chips keeps libtpu's own discovery: nothing is set."""
  from jax._src import hardware_utils  # the PCI scan JAX itself runs to find TPU chips
  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    return
  for name, value in (("TPU_ACCELERATOR_TYPE", "v5litepod-16"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(name, value)


def devices(name: str) -> list:
  """The compile-only devices of topology `name` (`CHIP:AxB[xC]`); UsageError naming the chips libtpu knows."""
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except jax.errors.JaxRuntimeError as e:
    known = ", ".join(chip for chip, _ in chips())
    raise UsageError(f"--topology={name}: {str(e).splitlines()[0]}; libtpu {libtpu_version()} knows the chips "
                     f"{known}, named CHIP:SHAPE (e.g. v5e:4x4, v5p:4x4x4)") from None


def chips() -> list[tuple[str, object]]:
  """(name, the device of its one-chip topology) of each of CHIP_NAMES the installed libtpu accepts."""
  from jax.experimental import topologies
  found = []
  for chip in CHIP_NAMES:
    try:
      found.append((chip, topologies.get_topology_desc(topology_name=f"{chip}:1x1", platform="tpu").devices[0]))
    except jax.errors.JaxRuntimeError:
      continue
  return found


def hbm_oom(error: Exception) -> dict | None:
  """{required_bytes, hbm_bytes} of the TPU compiler's out-of-memory error, None for any other error. What it calls
  the program's "HLO temporaries" is all it needs on a device, arguments and outputs included (a program adding 1
  to a 20 GiB argument needs 40 GiB); it states both figures in GiB (`G`, two decimals)."""
  m = _OOM.search(str(error))
  if m is None:
    return None
  return {"required_bytes": round(float(m.group(1)) * GIB), "hbm_bytes": round(float(m.group(2)) * GIB)}


def hbm_bytes(device) -> int:
  """The HBM the TPU compiler lets one program use on `device`'s chip (a little under the chip's HBM): read from its
  out-of-memory error for a program that needs 512 GiB of temporaries, more than any chip holds."""
  sharding = jax.sharding.SingleDeviceSharding(device)

  def oversized(x):  # a sort keeps its [2^16, 2^20] float32 input and output live: 2 x 256 GiB
    return jnp.sort(jnp.broadcast_to(x, (1 << 16, x.shape[0])) * 2.0, axis=0)[0]

  try:
    jax.jit(oversized).lower(jax.ShapeDtypeStruct((1 << 20,), np.float32, sharding=sharding)).compile()
  except jax.errors.JaxRuntimeError as e:
    oom = hbm_oom(e)
    if oom is not None:
      return oom["hbm_bytes"]
    raise
  raise RuntimeError(f"{device.device_kind}: a program needing 512 GiB compiled; its HBM cannot be read this way")
