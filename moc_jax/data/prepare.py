"""Tokenize local text once into ArrayRecord shards that `config.data.name = "arrayrecord:<dir>"` reads.

  python -m moc_jax.data.prepare --input 'corpus/*.jsonl' [--input more.txt ...] --output DIR --tokenizer byte
      [--split train] [--text_field text] [--shard_size 100000] [--txt_unit paragraph|file]
      [--max_doc_tokens 65536]

Inputs: .txt (one document per blank-line-separated paragraph by default, or per file with
--txt_unit file), .jsonl (one object per line, field --text_field), .parquet (column --text_field).
Malformed documents (blank, invalid UTF-8, bad JSON, missing or non-string field) are skipped and counted; the
first ten are named by file and line (.jsonl; paragraph for .txt, row for .parquet). A file with NUL bytes, or
none of whose documents is valid text, is refused by name (it is binary, or not what --text_field names).
A document longer than --max_doc_tokens is split into consecutive records of at most that many tokens (nothing is
dropped; 0 keeps every document whole), so one huge line never reaches the pipeline as one record.
Each record is one document's token ids (no BOS/EOS: the pipeline adds separators per layout), little-endian
uint16 when the vocabulary fits, else int32. `manifest.json` holds per-split files and counts plus the
tokenizer's spec and fingerprint, which the pipeline checks against `config.data.tokenizer`. Prepare other
splits (e.g. --split validation) into the same directory with the same tokenizer.

The split is written beside DIR under a temporary name and swapped in only once every input was read: a run that
fails (bad input, no valid document) leaves DIR's shards and manifest as they were.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil

import numpy as np
from absl import flags

from moc_jax import cli
from moc_jax.errors import DataError
from moc_jax.data.sources import MANIFEST, decode_text, read_manifest
from moc_jax.data.tokenizers import get_tokenizer

_PARAGRAPH_BREAK = re.compile(rb"\r?\n[ \t\r]*\n")
MAX_NAMED = 10  # malformed records named one by one; the rest are counted


def _refuse_binary(path, data):
  if b"\0" in data:
    raise DataError(f"{path}: NUL bytes: a binary file, not text; remove it from --input")


def _txt_documents(path, unit):
  with open(path, "rb") as f:
    data = f.read()
  _refuse_binary(path, data)
  chunks = [data] if unit == "file" else _PARAGRAPH_BREAK.split(data)
  paragraphs = (chunk.strip() for chunk in chunks)
  for n, chunk in enumerate((c for c in paragraphs if c), 1):  # runs of blank lines are separators, not documents
    yield decode_text(chunk), f"{path} paragraph {n}", "not UTF-8 text"


def _jsonl_documents(path, field):
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      _refuse_binary(path, line)
      yield _jsonl_text(line, field), f"{path}:{n}", f"invalid JSON or no text field {field!r}"


def _jsonl_text(line, field):
  try:
    row = json.loads(line)
  except ValueError:
    return None
  return decode_text(row.get(field)) if isinstance(row, dict) else None


def _parquet_documents(path, field):
  import pyarrow.parquet as pq
  parquet = pq.ParquetFile(path)
  if field not in parquet.schema_arrow.names:
    raise DataError(f"{path}: no column {field!r} (columns: {parquet.schema_arrow.names}); pass --text_field")
  n = 0
  for batch in parquet.iter_batches(columns=[field]):
    for value in batch.column(0).to_pylist():
      n += 1
      yield decode_text(value), f"{path} row {n}", "null, blank or not a string"


def documents(path, *, text_field="text", txt_unit="paragraph"):
  """Yields (text or None if malformed, where it is, what a malformed one lacks) for each document."""
  if path.endswith(".txt"):
    return _txt_documents(path, txt_unit)
  if path.endswith(".jsonl"):
    return _jsonl_documents(path, text_field)
  if path.endswith(".parquet"):
    return _parquet_documents(path, text_field)
  raise DataError(f"{path}: unsupported input type; use .txt, .jsonl or .parquet")


def expand_inputs(patterns) -> list[str]:
  paths = []
  for pattern in patterns:
    matches = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matches:
      raise DataError(f"--input {pattern!r} matches no file")
    paths.extend(matches)
  return paths


def pieces(ids, max_tokens):
  """`ids` cut into consecutive pieces of at most `max_tokens` (0: whole)."""
  if not max_tokens or len(ids) <= max_tokens:
    return [ids]
  return [ids[i:i + max_tokens] for i in range(0, len(ids), max_tokens)]


class _ShardWriter:
  """Records into `directory`/<split>-NNNNN.array_record, `shard_size` per file."""

  def __init__(self, directory, split, shard_size, dtype):
    self.directory, self.split, self.shard_size, self.dtype = directory, split, shard_size, dtype
    self.files, self.records, self._writer = [], 0, None

  def write(self, ids):
    from array_record.python.array_record_module import ArrayRecordWriter
    if self.records % self.shard_size == 0:
      self.close()
      self.files.append(f"{self.split}-{len(self.files):05d}.array_record")
      self._writer = ArrayRecordWriter(os.path.join(self.directory, self.files[-1]), "group_size:1")
    self._writer.write(np.asarray(ids, dtype=self.dtype).tobytes())
    self.records += 1

  def close(self):
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def prepare(inputs, output, tokenizer_spec, *, split="train", text_field="text", shard_size=100_000,
            txt_unit="paragraph", max_doc_tokens=65536) -> dict:
  """Writes `split`'s shards into `output`, updates the manifest and returns the split's entry; on any error
  `output` is left as it was."""
  if shard_size < 1:
    raise DataError(f"--shard_size must be >= 1, got {shard_size}")
  if max_doc_tokens < 0:
    raise DataError(f"--max_doc_tokens must be >= 0 (0: no limit), got {max_doc_tokens}")
  tokenizer = get_tokenizer(tokenizer_spec)
  paths = expand_inputs(inputs)
  output = os.path.abspath(os.path.expanduser(output))
  manifest = read_manifest(output) or {"splits": {}}
  others = sorted(set(manifest["splits"]) - {split})
  if others and manifest["tokenizer_fingerprint"] != tokenizer.fingerprint:
    raise DataError(f"{output} holds splits {others} tokenized with {manifest['tokenizer']!r}; prepare "
                    f"{tokenizer_spec!r} into another directory")
  dtype = np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<i4")
  staging = f"{output}.{split}.partial"  # beside `output`: the same file system, so the swap is a rename
  shutil.rmtree(staging, ignore_errors=True)  # a previous run's leftover: never a user's data
  os.makedirs(staging)
  try:
    entry = _write_split(paths, staging, split, tokenizer, dtype, shard_size, max_doc_tokens,
                         text_field=text_field, txt_unit=txt_unit)
    manifest.update({"format": 1, "tokenizer": tokenizer.spec, "tokenizer_fingerprint": tokenizer.fingerprint,
                     "vocab_size": tokenizer.vocab_size, "dtype": dtype.str})
    manifest["splits"][split] = entry
    _swap_in(staging, output, split, manifest)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return entry


def _write_split(paths, directory, split, tokenizer, dtype, shard_size, max_doc_tokens, **read_args):
  writer = _ShardWriter(directory, split, shard_size, dtype)
  counts = {"documents": 0, "tokens": 0, "malformed": 0, "split_documents": 0}
  named = []
  try:
    for path in paths:
      valid = 0
      for text, where, lack in documents(path, **read_args):
        ids = tokenizer.encode(text) if text is not None else []
        if not ids:
          counts["malformed"] += 1
          named += [f"{where}: {lack}"] if len(named) < MAX_NAMED else []
          continue
        valid += 1
        parts = pieces(ids, max_doc_tokens)
        counts["split_documents"] += len(parts) > 1
        for part in parts:
          writer.write(part)
        counts["documents"] += 1
        counts["tokens"] += len(ids)
      if not valid:
        raise DataError(f"{path}: no valid document (not text, or no {read_args['text_field']!r} field/column); "
                        "check the file or --text_field")
  finally:
    writer.close()
  return {"files": writer.files, **counts, "records": writer.records, "malformed_named": named, "inputs": paths}


def _swap_in(staging, output, split, manifest):
  """Moves the staged shards into `output` in place of the split's old ones, then writes the manifest."""
  os.makedirs(output, exist_ok=True)
  for stale in glob.glob(os.path.join(output, f"{split}-*.array_record")):
    os.remove(stale)
  for name in manifest["splits"][split]["files"]:
    os.replace(os.path.join(staging, name), os.path.join(output, name))
  tmp = os.path.join(output, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=2)
  os.replace(tmp, os.path.join(output, MANIFEST))


_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_multi_string("input", None, "a file or glob (.txt, .jsonl, .parquet)",
                          required=True, flag_values=_FLAGS)
flags.DEFINE_string("output", None, "directory for the shards and manifest.json", required=True, flag_values=_FLAGS)
flags.DEFINE_string("tokenizer", "byte", "byte | hf:<tokenizer.json> | sp:<model.model>", flag_values=_FLAGS)
flags.DEFINE_string("split", "train", "the split these documents are", flag_values=_FLAGS)
flags.DEFINE_string("text_field", "text", "the field (.jsonl) or column (.parquet) holding the text",
                    flag_values=_FLAGS)
flags.DEFINE_integer("shard_size", 100_000, "documents per shard", flag_values=_FLAGS)
flags.DEFINE_integer("max_doc_tokens", 65536, "a longer document is split into records of at most this many tokens "
                     "(0: no limit)", flag_values=_FLAGS)
flags.DEFINE_enum("txt_unit", "paragraph", ("paragraph", "file"), "the document of a .txt file", flag_values=_FLAGS)


@cli.exit_on_error
def main(argv=None):
  args = cli.parse_command(_FLAGS, argv)
  entry = prepare(args.input, args.output, args.tokenizer, split=args.split, text_field=args.text_field,
                  shard_size=args.shard_size, txt_unit=args.txt_unit, max_doc_tokens=args.max_doc_tokens)
  print(f"{args.output}: split {args.split!r}: {entry['documents']} documents, {entry['tokens']} tokens, "
        f"{entry['malformed']} malformed skipped, {entry['split_documents']} split at {args.max_doc_tokens} tokens, "
        f"{len(entry['files'])} shard(s)")
  for where in entry["malformed_named"]:
    print(f"  malformed: {where}")
  if entry["malformed"] > len(entry["malformed_named"]):
    print(f"  ... and {entry['malformed'] - len(entry['malformed_named'])} more malformed")


if __name__ == "__main__":
  main()
