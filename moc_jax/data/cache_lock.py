"""One process at a time builds a cached data file (a generated corpus, a fitted cluster tree).

Runs of a sweep start together and would each build the same file, racing for the cores and the memory (twice
a large corpus's working set); under this lock the first builds it and the others wait, then find it built: each
checks again for the file once it holds the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def exclusive(lock_path: str):
  """Holds an exclusive lock on `lock_path` (created with its directory) until the block ends; released by the
  kernel if the process dies, so a killed build never leaves the others waiting."""
  os.makedirs(os.path.dirname(lock_path) or ".", exist_ok=True)
  with open(lock_path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield
