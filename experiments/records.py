"""A study's record: what its directory holds of its runs, kept apart from it: the finished runs without their
checkpoints, the stopped ones with their newest.

A study of many hours runs in parts, and a part may start where the last part's directory is gone (a machine that
keeps nothing from one job to the next) or is elsewhere (another machine). `save` copies each complete run's files (its
config, its metrics, its evaluation) and its manifest entry into RECORDS, the metrics compressed (about 160 kB for a
run of 100,000 updates logged every 50), small enough to keep in version control; `restore` puts into DIR each
recorded run that DIR has no workdir of. A restored run is done as sweeps.runs.finished reads it (its final
evaluation, no checkpoints/), so the launcher never trains it again and the reports read it as they read the run
itself; its wall time and attempts come with it, so a study's stated compute counts every part.

A run stopped before it was complete (a part's Ctrl-C or SIGTERM, or trained but not yet evaluated) is kept too, with
its newest checkpoint (its parameters, optimizer and data-iterator state: about 1 MB for the capacity study's models),
so that the next part resumes it from there instead of from step 0: a run of hours is not lost because no one part
was long enough for it, and, resumed from the same checkpoint, it follows the same curve. The record keeps one
checkpoint a run, replaced as the run goes on, and none once it is complete. What DIR holds is never overwritten:
a run DIR has (finished, or stopped and about to resume) stays DIR's.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil

from experiments.evaluation import EVAL_TIME
from experiments.sweeps.runs import latest_checkpoint, read_manifest, write_manifest
from moc_jax.config.schema import base_config
from moc_jax.errors import UsageError

FILES = ("config.json", "eval.json", EVAL_TIME)  # copied as they are
METRICS, PACKED = "metrics.jsonl", "metrics.jsonl.gz"  # a run's metrics, and as the record keeps them
REPORT_FILES = ("recall_vs_tokens.png",)  # a sweep's figures, beside its runs, so the record's report shows them
CHECKPOINTS = "checkpoints"


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
  to its end and evaluated as its study evaluates it), and each other run with a checkpoint, with its newest
  (`_copy_checkpoint`); their manifest entries with their workdirs relative to the record, and the sweep's figures.
  Runs recorded before stay recorded, and a complete one is never replaced by a stopped one. Returns the runs newly
  recorded complete."""
  added = 0
  for sweep in sweeps:
    source, target = os.path.join(out, sweep), os.path.join(records, sweep)
    kept = {e["name"]: e for e in read_manifest(target)}
    for e in read_manifest(source):
      workdir, copy = os.path.join(source, e["name"]), os.path.join(target, e["name"])
      done = complete(workdir, e)
      step = None if done else latest_checkpoint(workdir)
      if not done and (step is None or _is_complete(kept.get(e["name"]))):
        continue
      if step is not None and not _copy_checkpoint(workdir, copy, step):
        continue  # the run saved a newer step meanwhile: the record keeps the one it had
      os.makedirs(copy, exist_ok=True)
      for name in FILES:
        if os.path.isfile(os.path.join(workdir, name)):
          _write(os.path.join(copy, name), _read(os.path.join(workdir, name)))
      # mtime=0: the same metrics pack to the same bytes, so saving again changes no file
      _write(os.path.join(copy, PACKED), gzip.compress(_read(os.path.join(workdir, METRICS)), mtime=0))
      if done:
        shutil.rmtree(os.path.join(copy, CHECKPOINTS), ignore_errors=True)
        added += not _is_complete(kept.get(e["name"]))
      # a stopped run is recorded as the next part finds it, not running: that part's launcher resumes it
      status = "done" if done else "failed" if e.get("status") == "failed" else "pending"
      kept[e["name"]] = {**e, "workdir": e["name"], "status": status}
    if not kept:
      continue
    write_manifest(target, kept.values())
    for name in REPORT_FILES:
      if os.path.isfile(os.path.join(source, name)):
        _write(os.path.join(target, name), _read(os.path.join(source, name)))
  return added


def _is_complete(entry) -> bool:
  return entry is not None and entry.get("status") == "done"


def _copy_checkpoint(workdir, copy, step) -> bool:
  """Makes COPY/checkpoints hold exactly the run's checkpoint `step`, whole or not at all; False (nothing changed)
  when the run, still training in another invocation, deleted that step while it was copied."""
  held = os.path.join(copy, CHECKPOINTS)
  if os.path.isdir(held) and os.listdir(held) == [str(step)]:
    return True  # the same step: Orbax never rewrites a finished step
  partial = os.path.join(copy, CHECKPOINTS + ".saving")
  shutil.rmtree(partial, ignore_errors=True)
  try:
    shutil.copytree(os.path.join(workdir, CHECKPOINTS, str(step)), os.path.join(partial, str(step)))
  except (FileNotFoundError, shutil.Error):
    shutil.rmtree(partial, ignore_errors=True)
    return False
  shutil.rmtree(held, ignore_errors=True)
  os.rename(partial, held)
  return True


def _flat(tree, prefix="") -> dict:
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
  return out


def _check(records, sweep, entry, planned) -> None:
  """A recorded run that its study now plans under its name must have been trained with the config the study now
  makes of it (`planned`: its config.json as moc_jax.main would write it); one line naming the first field that
  differs otherwise: the study's configs changed under its record, and counting the run would mix two studies.
  A field its config.json lacks was added to moc_jax after the run: the run was trained with the field's default,
  which by the rule for new fields reproduces what moc_jax did before it."""
  if planned is None:
    return
  with open(os.path.join(records, sweep, entry["name"], "config.json")) as f:
    saved, now = _flat(json.load(f)), _flat(planned)
  defaults = _flat(json.loads(base_config().to_json_best_effort(sort_keys=True)))
  for key in sorted(set(saved) | set(now)):
    trained = saved.get(key, defaults.get(key))
    if trained != now.get(key):
      raise UsageError(f"--records={records}: its run {sweep}/{entry['name']} was trained with {key}="
                       f"{trained!r} where the study now makes {now.get(key)!r}; run the moc_jax and configs "
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
      if os.path.isdir(os.path.join(copy, CHECKPOINTS)):  # a stopped run: the launcher resumes it from there
        shutil.copytree(os.path.join(copy, CHECKPOINTS), os.path.join(partial, CHECKPOINTS))
      os.rename(partial, workdir)
    if fresh:
      names = {e["name"] for e in fresh}
      kept = [e for e in read_manifest(target) if e["name"] not in names]
      write_manifest(target, [*kept, *({**e, "workdir": os.path.join(target, e["name"])} for e in fresh)])
      restored += len(fresh)
  return restored
