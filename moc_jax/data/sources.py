"""Random-access record sources for `config.data.name`, each with its record -> (input_ids, labels) function.

A source is (records, to_example): `records` has `len` and `__getitem__` (what grain's MapDataset needs);
`to_example(record)` returns int32 (input_ids, labels) or None for a malformed record (empty text, invalid
UTF-8, missing field, non-string, bad JSON, corrupt token record), which the pipeline skips and counts.
Every missing piece raises one DataError that says how to prepare it.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from moc_jax.errors import DataError
from moc_jax.data.chat import chat_example

MANIFEST = "manifest.json"
PREPARE_HINT = ("python -m moc_jax.data.prepare --input 'corpus/*.jsonl' --output {dir} --tokenizer {tokenizer} "
                "--split {split}")


def data_dir(config_data) -> str:
  return os.path.abspath(os.path.expanduser(config_data.data_dir))


def decode_text(value):
  """The record's text, or None if it is missing, not a string, not UTF-8 or blank."""
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError:
      return None
  return value if isinstance(value, str) and value.strip() else None


def text_example(record, *, field, tokenizer):
  text = decode_text(record.get(field)) if isinstance(record, Mapping) else None
  if text is None:
    return None
  ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
  return (ids, ids) if len(ids) else None


def token_example(record, *, dtype, vocab_size):
  dtype = np.dtype(dtype)
  if not isinstance(record, bytes) or not record or len(record) % dtype.itemsize:
    return None
  ids = np.frombuffer(record, dtype=dtype).astype(np.int32)
  return (ids, ids) if ids.min() >= 0 and ids.max() < vocab_size else None


def jsonl_chat_example(line, *, tokenizer, chat_format):
  try:
    row = json.loads(line)
  except ValueError:  # includes invalid UTF-8 and bad JSON
    return None
  return chat_example(row, tokenizer, chat_format)


class JsonlLines(Sequence):
  """Random access to the non-empty lines of a .jsonl file via a byte-offset index (the file stays on disk)."""

  def __init__(self, path: str):
    starts, ends, offset = [np.zeros(1, np.int64)], [], 0
    with open(path, "rb") as f:
      while chunk := f.read(1 << 24):
        newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")).astype(np.int64) + offset
        ends.append(newlines)
        starts.append(newlines + 1)
        offset += len(chunk)
    ends.append(np.array([offset], np.int64))
    starts, ends = np.concatenate(starts), np.concatenate(ends)
    keep = ends > starts
    self._starts, self._lengths = starts[keep], (ends - starts)[keep]
    self._fd = os.open(path, os.O_RDONLY)

  def __len__(self):
    return len(self._starts)

  def __getitem__(self, index):
    return os.pread(self._fd, int(self._lengths[index]), int(self._starts[index]))

  def __del__(self):
    if getattr(self, "_fd", None) is not None:
      os.close(self._fd)


def _split_path(template: str, split: str, kind: str) -> str:
  """`{split}` in a path selects the split's file; without it the file is the train split only."""
  if "{split}" in template:
    return os.path.expanduser(template.format(split=split))
  if split != "train":
    raise DataError(f"{kind} path {template!r} names one file, used as the train split; for split {split!r} "
                    f"put '{{split}}' in the path (e.g. 'chat:data/ultrachat_{{split}}.jsonl').")
  return os.path.expanduser(template)


def _facts_source(config_data, split):
  from moc_jax.data.facts import facts_builder
  builder = facts_builder(config_data.facts, data_dir(config_data))
  if split not in builder.info.splits:
    raise DataError(f"moc_facts has splits {sorted(builder.info.splits)}, not {split!r}")
  return builder.as_data_source(split=split)


def _tfds_source(config_data, split):
  import tensorflow_datasets as tfds
  name, root = config_data.name.partition(":")[2], data_dir(config_data)
  build = f"`tfds build {name.split('/')[0]} --data_dir={root} --file_format=array_record`"
  try:
    builder = tfds.builder(name, data_dir=root, try_gcs=False)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(f"TFDS dataset {name!r} is unknown and not prepared under {root}: prepare it with {build} "
                    "on a machine with network access and copy the directory here") from e
  if not builder.is_prepared():
    raise DataError(f"TFDS dataset {name!r} is not prepared under {root}: run {build} (it downloads; on an "
                    f"offline machine copy a prepared {name.split('/')[0]}/ directory into {root})")
  if builder.info.file_format not in (tfds.core.FileFormat.ARRAY_RECORD, tfds.core.FileFormat.PARQUET):
    raise DataError(f"TFDS dataset {name!r} under {root} is stored as {builder.info.file_format}, which has no "
                    f"random access: re-prepare it with {build}")
  if split not in builder.info.splits:
    raise DataError(f"TFDS dataset {name!r} has splits {sorted(builder.info.splits)}, not {split!r}")
  return builder.as_data_source(split=split)


def read_manifest(directory: str) -> dict | None:
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def _arrayrecord_source(config_data, split, tokenizer):
  import grain
  directory = os.path.abspath(os.path.expanduser(config_data.name.partition(":")[2]))
  hint = PREPARE_HINT.format(dir=directory, tokenizer=config_data.tokenizer, split=split)
  manifest = read_manifest(directory)
  if manifest is None:
    raise DataError(f"no prepared ArrayRecord dataset at {directory} ({MANIFEST} missing): run `{hint}`")
  if manifest["tokenizer_fingerprint"] != tokenizer.fingerprint:
    raise DataError(f"{directory} was tokenized with {manifest['tokenizer']!r} but config.data.tokenizer is "
                    f"{tokenizer.spec!r}: set the same tokenizer, or re-run `{hint}` into another directory")
  if split not in manifest["splits"]:
    raise DataError(f"{directory} has splits {sorted(manifest['splits'])}, not {split!r}: run `{hint}`")
  paths = [os.path.join(directory, p) for p in manifest["splits"][split]["files"]]
  if missing := [p for p in paths if not os.path.isfile(p)]:
    raise DataError(f"{directory}: shard files listed in {MANIFEST} are missing ({missing[:3]}): re-run `{hint}`")
  return grain.sources.ArrayRecordDataSource(paths), functools.partial(
      token_example, dtype=manifest["dtype"], vocab_size=tokenizer.vocab_size)


def _chat_source(config_data, split, tokenizer):
  path = _split_path(config_data.name.partition(":")[2], split, "chat")
  if not os.path.isfile(path):
    raise DataError(f"chat file {path!r} not found: write one JSON object per line, "
                    '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}')
  return JsonlLines(path), functools.partial(jsonl_chat_example, tokenizer=tokenizer,
                                             chat_format=config_data.chat_format)


def open_source(config_data, split: str, tokenizer) -> tuple[Sequence, Callable]:
  """(records, to_example) for `config_data.name` and `split`."""
  name = config_data.name
  if name == "moc_facts":
    return _facts_source(config_data, split), functools.partial(text_example, field="text", tokenizer=tokenizer)
  if name.startswith("tfds:") and len(name) > 5:
    return _tfds_source(config_data, split), functools.partial(
        text_example, field=config_data.text_field, tokenizer=tokenizer)
  if name.startswith("arrayrecord:") and len(name) > 12:
    return _arrayrecord_source(config_data, split, tokenizer)
  if name.startswith("chat:") and len(name) > 5:
    return _chat_source(config_data, split, tokenizer)
  raise DataError(f"config.data.name: unknown dataset {name!r}; use 'moc_facts', 'tfds:<name>[/config]', "
                  "'arrayrecord:<dir>' or 'chat:<path.jsonl>'")
