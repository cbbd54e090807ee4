"""What a sweep directory holds on disk, read and written by the launcher and the report alike.

A sweep directory holds one workdir per point (named from its overrides, e.g. `k8-bank1040`) and
manifest.jsonl, one line per point: name, overrides, workdir, command, status (pending | running | done |
failed; a run stopped at a checkpoint is pending), return code, wall time. A point is done when its workdir
holds the validation row and (if it holds checkpoints/) the checkpoint of its last step.
"""
from __future__ import annotations

import json
import os

MANIFEST = "manifest.jsonl"
LOG = "sweep.log"


def read_metrics(workdir: str) -> list[dict]:
  rows = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          pass  # a line cut by a kill
  except FileNotFoundError:
    pass
  return rows


def final_eval(workdir: str, steps: int) -> dict | None:
  """The validation row the training loop writes after its last step, if it got there."""
  rows = [r for r in read_metrics(workdir) if r.get("split") == "validation" and r.get("step") == steps]
  return rows[-1] if rows else None


def latest_checkpoint(workdir: str) -> int | None:
  """The newest finished Orbax step (an interrupted save leaves only a temporary directory)."""
  try:
    steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  except FileNotFoundError:
    return None
  return max(steps, default=None)


def finished(workdir: str, steps: int) -> bool:
  """Done: the last evaluation logged and, where checkpoints live here (not on a pod), the last checkpoint."""
  if final_eval(workdir, steps) is None:
    return False
  return not os.path.isdir(os.path.join(workdir, "checkpoints")) or latest_checkpoint(workdir) == steps


def read_manifest(sweep_dir: str) -> list[dict]:
  path = os.path.join(sweep_dir, MANIFEST)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_manifest(sweep_dir: str, entries) -> None:
  path = os.path.join(sweep_dir, MANIFEST)
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(e) + "\n" for e in entries)
  os.replace(path + ".tmp", path)
