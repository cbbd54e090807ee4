"""A study's record: what its directory holds of its finished runs, without their checkpoints, kept apart from it.

A study of many hours runs in parts, and a part may start where the last part's directory is gone (a machine that
keeps nothing from one job to the next) or is elsewhere (another machine). `save` copies each complete run's files (its
config, its metrics, its evaluation) and its manifest entry into RECORDS, the metrics compressed (about 160 kB for a
run of 100,000 updates logged every 50), small enough to keep in version control; `restore` puts into DIR each
recorded run that DIR has no workdir of. A restored run is done as sweeps.runs.finished reads it (its final
evaluation, no checkpoints/), so the launcher never trains it again and the reports read it as they read the run
itself; its wall time and attempts come with it, so a study's
stated compute counts every part. What DIR holds is never overwritten: a run DIR has (finished, or stopped and
about to resume) stays DIR's.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil

from experiments.evaluation import EVAL_TIME
from experiments.sweeps.runs import read_manifest, write_manifest
from moc_jax.errors import UsageError

FILES = ("config.json", "eval.json", EVAL_TIME)  # copied as they are
METRICS, PACKED = "metrics.jsonl", "metrics.jsonl.gz"  # a run's metrics, and as the record keeps them
REPORT_FILES = ("recall_vs_tokens.png",)  # a sweep's figures, beside its runs, so the record's report shows them


def _write(path, data: bytes) -> None:
  """`data` into `path` whole or not at all (a stop mid-write leaves the old file, or none)."""
  with open(path + ".tmp", "wb") as f:
    f.write(data)
  os.replace(path + ".tmp", path)


def _read(path) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def save(out, records, sweeps, complete) -> int:
  """Copies into RECORDS/<sweep>/ each run of DIR/<sweep> that `complete(workdir, manifest entry)` accepts (trained
  to its end and evaluated as its study evaluates it), its manifest entry with its workdir relative to the record,
  and the sweep's figures; runs recorded before stay recorded. Returns the runs newly recorded."""
  added = 0
  for sweep in sweeps:
    source = os.path.join(out, sweep)
    entries = [e for e in read_manifest(source) if complete(os.path.join(source, e["name"]), e)]
    if not entries:
      continue
    target = os.path.join(records, sweep)
    kept = {e["name"]: e for e in read_manifest(target)}
    for e in entries:
      workdir, copy = os.path.join(source, e["name"]), os.path.join(target, e["name"])
      os.makedirs(copy, exist_ok=True)
      for name in FILES:
        if os.path.isfile(os.path.join(workdir, name)):
          _write(os.path.join(copy, name), _read(os.path.join(workdir, name)))
      # mtime=0: the same metrics pack to the same bytes, so saving again changes no file
      _write(os.path.join(copy, PACKED), gzip.compress(_read(os.path.join(workdir, METRICS)), mtime=0))
      added += e["name"] not in kept
      kept[e["name"]] = {**e, "workdir": e["name"]}
    write_manifest(target, kept.values())
    for name in REPORT_FILES:
      if os.path.isfile(os.path.join(source, name)):
        _write(os.path.join(target, name), _read(os.path.join(source, name)))
  return added


def _flat(tree, prefix="") -> dict:
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
  return out


def _check(records, sweep, entry, planned) -> None:
  """A recorded run that its study now plans under its name must have been trained with the config the study now
  makes of it (`planned`: its config.json as moc_jax.main would write it); one line naming the first field that
  differs otherwise: the study's configs changed under its record, and counting the run would mix two studies."""
  if planned is None:
    return
  with open(os.path.join(records, sweep, entry["name"], "config.json")) as f:
    saved, now = _flat(json.load(f)), _flat(planned)
  for key in sorted(set(saved) | set(now)):
    if saved.get(key) != now.get(key):
      raise UsageError(f"--records={records}: its run {sweep}/{entry['name']} was trained with {key}="
                       f"{saved.get(key)!r} where the study now makes {now.get(key)!r}; run the moc_jax and configs "
                       "it was trained with, or start another --records")


def restore(records, out, sweeps, spec, planned=None) -> int:
  """Puts each run of RECORDS/<sweep>/ that DIR/<sweep> has no workdir of into DIR (its files, then its manifest
  entry); returns how many. A record of another config (`spec`), or a run whose config is not what `planned`
  ({(sweep, run name): config as a dict}) now makes of that run, is refused with one line before anything is
  copied."""
  found = {sweep: read_manifest(os.path.join(records, sweep)) for sweep in sweeps}
  for sweep, entries in found.items():
    other = sorted({e.get("config") for e in entries} - {spec})
    if other:
      raise UsageError(f"--records={records}: its sweep {sweep} holds runs of --config={other[0]}, not {spec}; pass "
                       "that --config, or a --records of this one's")
    for e in entries:
      _check(records, sweep, e, (planned or {}).get((sweep, e["name"])))
  restored = 0
  for sweep, entries in found.items():
    target = os.path.join(out, sweep)
    fresh = [e for e in entries if not os.path.exists(os.path.join(target, e["name"]))]
    for e in fresh:
      copy, workdir = os.path.join(records, sweep, e["name"]), os.path.join(target, e["name"])
      partial = workdir + ".restoring"  # renamed into place whole: a stop leaves no half-restored run
      shutil.rmtree(partial, ignore_errors=True)
      os.makedirs(partial)
      for name in FILES:
        if os.path.isfile(os.path.join(copy, name)):
          shutil.copyfile(os.path.join(copy, name), os.path.join(partial, name))
      _write(os.path.join(partial, METRICS), gzip.decompress(_read(os.path.join(copy, PACKED))))
      os.rename(partial, workdir)
    if fresh:
      names = {e["name"] for e in fresh}
      kept = [e for e in read_manifest(target) if e["name"] not in names]
      write_manifest(target, [*kept, *({**e, "workdir": os.path.join(target, e["name"])} for e in fresh)])
      restored += len(fresh)
  return restored
