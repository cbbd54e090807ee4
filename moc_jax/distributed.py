"""Multi-host (multi-controller) start-up: one Python process per host, joined through `jax.distributed`.

Every process runs the same program; each owns its local devices and feeds only its own share of the data
(the train loop reads `jax.process_index()` / `jax.process_count()`). `initialize` must run before anything
touches a JAX backend (devices, arrays, jit), because the backends are created with the cluster's view.

Values come from the arguments (the `--coordinator_address`, `--num_processes`, `--process_id` flags), else
from the environment (`MOC_JAX_COORDINATOR_ADDRESS`, `MOC_JAX_NUM_PROCESSES`, `MOC_JAX_PROCESS_ID`), so a
launcher can set them per process without changing the command line.
"""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("moc_jax")

ENV = {"coordinator_address": "MOC_JAX_COORDINATOR_ADDRESS", "num_processes": "MOC_JAX_NUM_PROCESSES",
       "process_id": "MOC_JAX_PROCESS_ID"}


def _names(field):
  return f"--{field} / {ENV[field]}"


def _resolve(field, value, cast):
  """The explicit value, else the environment variable's (empty counts as unset)."""
  if value is None:
    value = os.environ.get(ENV[field]) or None
  if value is None or cast is str:
    return value
  try:
    if isinstance(value, bool) or int(value) != float(value):
      raise ValueError
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{_names(field)}: expected an integer, got {value!r}") from None


def _check_address(address):
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{_names('coordinator_address')}: expected HOST:PORT (e.g. 10.0.0.1:1234), got {address!r}")


def resolve(coordinator_address=None, num_processes=None, process_id=None, enable=False):
  """(address, num_processes, process_id) after defaults and checks; ValueError names the bad flag."""
  address = _resolve("coordinator_address", coordinator_address, str)
  n = _resolve("num_processes", num_processes, int)
  pid = _resolve("process_id", process_id, int)
  if address is None:
    if not enable and (n is not None or pid is not None):
      raise ValueError(f"{_names('num_processes')} and {_names('process_id')} need {_names('coordinator_address')} "
                       "(or --distributed to let JAX detect the cluster)")
  else:
    _check_address(address)
    missing = [f for f, v in (("num_processes", n), ("process_id", pid)) if v is None]
    if missing:
      raise ValueError(f"{_names('coordinator_address')} is set, so {' and '.join(map(_names, missing))} "
                       "must be too (every process: the same address and count, its own id)")
  if n is not None and n < 1:
    raise ValueError(f"{_names('num_processes')}: must be >= 1, got {n}")
  if pid is not None and (pid < 0 or (n is not None and pid >= n)):
    raise ValueError(f"{_names('process_id')}: must be in [0, num_processes={n}), got {pid}")
  return address, n, pid


def initialize(coordinator_address=None, num_processes=None, process_id=None, enable=False) -> bool:
  """Joins the cluster; True if this is now a multi-controller run, False for a plain single process.

  With an address (argument or env): `jax.distributed.initialize(address, num_processes, process_id)`.
  With only `enable=True`: `jax.distributed.initialize()` with no arguments, which detects TPU pods, SLURM,
  Open MPI and similar environments itself. Otherwise nothing happens.
  """
  address, n, pid = resolve(coordinator_address, num_processes, process_id, enable)
  if address is None and not enable:
    return False
  if jax.distributed.is_initialized():
    return True
  # CPU devices need a cross-process collectives backend, or a multi-process CPU run fails at its first
  # all-reduce; gloo needs nothing installed. Harmless on accelerator hosts (it only concerns CPU devices);
  # an explicit MPI choice (JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi) is kept.
  if jax.config.jax_cpu_collectives_implementation not in ("mpi", "megascale"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if address is None:  # whatever was given joins what JAX detects
    jax.distributed.initialize(**{k: v for k, v in (("num_processes", n), ("process_id", pid)) if v is not None})
  else:
    jax.distributed.initialize(address, n, pid)
  log.warning("moc_jax: process %d of %d; %d local / %d global devices", jax.process_index(),
              jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def workdir_note(workdir: str, process_count: int) -> str | None:
  """A warning for a multi-process run whose workdir is a path on each host's own disk (no URL scheme such as
  gs://): every process writes its shards of each checkpoint to the workdir, so the hosts must see one directory
  (a bucket or a shared file system), which a local path may not be. None when it need not be said."""
  if process_count <= 1 or "://" in workdir:
    return None
  return (f"moc_jax: {process_count} processes write their checkpoint shards to {workdir!r}: every host must see "
          "that same directory (gs://BUCKET/... or a shared file system), or no host can restore them")

