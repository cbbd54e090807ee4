"""Tokenize local text once into ArrayRecord shards that `config.data.name = "arrayrecord:<dir>"` reads.

  python -m moc_jax.data.prepare --input 'corpus/*.jsonl' [--input more.txt ...] --output DIR --tokenizer byte
      [--split train] [--text_field text] [--shard_size 100000] [--txt_unit paragraph|file]

Inputs: .txt (one document per blank-line-separated paragraph by default, or per file with
--txt_unit file), .jsonl (one object per line, field --text_field), .parquet (column --text_field).
Malformed documents (blank, invalid UTF-8, bad JSON, missing or non-string field) are skipped and counted.
Each record is one document's token ids (no BOS/EOS: the pipeline adds separators per layout), little-endian
uint16 when the vocabulary fits, else int32. `manifest.json` holds per-split files and counts plus the
tokenizer's spec and fingerprint, which the pipeline checks against `config.data.tokenizer`. Prepare other
splits (e.g. --split validation) into the same directory with the same tokenizer.
"""
from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
from absl import flags

from moc_jax import cli
from moc_jax.errors import DataError
from moc_jax.data.sources import MANIFEST, decode_text, read_manifest
from moc_jax.data.tokenizers import get_tokenizer

_PARAGRAPH_BREAK = re.compile(rb"\r?\n[ \t\r]*\n")


def _txt_documents(path, unit):
  with open(path, "rb") as f:
    data = f.read()
  chunks = [data] if unit == "file" else _PARAGRAPH_BREAK.split(data)
  for chunk in chunks:
    if chunk.strip():  # runs of blank lines are separators, not documents
      yield decode_text(chunk.strip())


def _jsonl_documents(path, field):
  with open(path, "rb") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        yield None
        continue
      yield decode_text(row.get(field)) if isinstance(row, dict) else None


def _parquet_documents(path, field):
  import pyarrow.parquet as pq
  parquet = pq.ParquetFile(path)
  if field not in parquet.schema_arrow.names:
    raise DataError(f"{path}: no column {field!r} (columns: {parquet.schema_arrow.names}); pass --text_field")
  for batch in parquet.iter_batches(columns=[field]):
    for value in batch.column(0).to_pylist():
      yield decode_text(value)


def documents(path, *, text_field="text", txt_unit="paragraph"):
  """Yields each document's text, or None for a malformed one."""
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


def prepare(inputs, output, tokenizer_spec, *, split="train", text_field="text", shard_size=100_000,
            txt_unit="paragraph") -> dict:
  """Writes `split`'s shards into `output`, updates the manifest and returns the split's entry."""
  from array_record.python.array_record_module import ArrayRecordWriter
  if shard_size < 1:
    raise DataError(f"--shard_size must be >= 1, got {shard_size}")
  tokenizer = get_tokenizer(tokenizer_spec)
  paths = expand_inputs(inputs)
  output = os.path.abspath(os.path.expanduser(output))
  os.makedirs(output, exist_ok=True)
  manifest = read_manifest(output) or {"splits": {}}
  others = sorted(set(manifest["splits"]) - {split})
  if others and manifest["tokenizer_fingerprint"] != tokenizer.fingerprint:
    raise DataError(f"{output} holds splits {others} tokenized with {manifest['tokenizer']!r}; prepare "
                    f"{tokenizer_spec!r} into another directory")
  for stale in glob.glob(os.path.join(output, f"{split}-*.array_record")):
    os.remove(stale)

  dtype = np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<i4")
  files, writer = [], None
  counts = {"documents": 0, "tokens": 0, "malformed": 0}
  for path in paths:
    for text in documents(path, text_field=text_field, txt_unit=txt_unit):
      ids = tokenizer.encode(text) if text is not None else []
      if not ids:
        counts["malformed"] += 1
        continue
      if counts["documents"] % shard_size == 0:
        if writer is not None:
          writer.close()
        files.append(f"{split}-{len(files):05d}.array_record")
        writer = ArrayRecordWriter(os.path.join(output, files[-1]), "group_size:1")
      writer.write(np.asarray(ids, dtype=dtype).tobytes())
      counts["documents"] += 1
      counts["tokens"] += len(ids)
  if writer is not None:
    writer.close()
  if not counts["documents"]:
    raise DataError(f"no valid document in {paths} ({counts['malformed']} malformed)")

  entry = {"files": files, **counts, "inputs": paths}
  manifest.update({"format": 1, "tokenizer": tokenizer.spec, "tokenizer_fingerprint": tokenizer.fingerprint,
                   "vocab_size": tokenizer.vocab_size, "dtype": dtype.str})
  manifest["splits"][split] = entry
  tmp = os.path.join(output, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=2)
  os.replace(tmp, os.path.join(output, MANIFEST))
  return entry


_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_multi_string("input", None, "a file or glob (.txt, .jsonl, .parquet)",
                          required=True, flag_values=_FLAGS)
flags.DEFINE_string("output", None, "directory for the shards and manifest.json", required=True, flag_values=_FLAGS)
flags.DEFINE_string("tokenizer", "byte", "byte | hf:<tokenizer.json> | sp:<model.model>", flag_values=_FLAGS)
flags.DEFINE_string("split", "train", "the split these documents are", flag_values=_FLAGS)
flags.DEFINE_string("text_field", "text", "the field (.jsonl) or column (.parquet) holding the text",
                    flag_values=_FLAGS)
flags.DEFINE_integer("shard_size", 100_000, "documents per shard", flag_values=_FLAGS)
flags.DEFINE_enum("txt_unit", "paragraph", ("paragraph", "file"), "the document of a .txt file", flag_values=_FLAGS)


@cli.exit_on_error
def main(argv=None):
  args = cli.parse_command(_FLAGS, argv)
  entry = prepare(args.input, args.output, args.tokenizer, split=args.split, text_field=args.text_field,
                  shard_size=args.shard_size, txt_unit=args.txt_unit)
  print(f"{args.output}: split {args.split!r}: {entry['documents']} documents, {entry['tokens']} tokens, "
        f"{entry['malformed']} malformed skipped, {len(entry['files'])} shard(s)")


if __name__ == "__main__":
  main()
