"""One training process per workdir: an exclusive lock on WORKDIR/.lock for the whole run.

Two runs writing one workdir interleave metrics.jsonl, race on checkpoints and TensorBoard files, and both
exit 0. The lock is `flock` on an open file, so the kernel releases it when its process ends in any way
(SIGKILL included): a stale lock cannot block a resume. The file also names the holder (host, pid, start
time), for the refusal message; a holder left in it by a process that died without releasing is reported
as taken over. Process 0 alone takes it in a multi-process run (the others write nothing of their own).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time

from moc_jax.errors import TrainingError

log = logging.getLogger("moc_jax")

LOCK_FILE = ".lock"


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Holds the workdir's lock while the block runs; TrainingError naming the holder if another process has it."""
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise TrainingError(f"{workdir} is in use by another training run ({_holder(fd)}); wait for it to end or "
                          "stop it (SIGTERM saves a checkpoint), or pass another --workdir") from None
    previous = _holder(fd)
    if previous != "unknown":
      log.warning("moc_jax: %s: lock of a run that ended without releasing it (%s) taken over", workdir, previous)
    _write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
    try:
      yield
    finally:
      _write(fd, "")  # released: an empty file is no holder
  finally:
    os.close(fd)  # closing the descriptor releases the flock


def _holder(fd) -> str:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
  try:
    h = json.loads(text)
    return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
  except (ValueError, KeyError, TypeError):
    return "unknown"


def _write(fd, text):
  os.ftruncate(fd, 0)
  os.lseek(fd, 0, os.SEEK_SET)
  os.write(fd, text.encode())
  os.fsync(fd)
