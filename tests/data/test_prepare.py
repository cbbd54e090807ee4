"""prepare: .txt / .jsonl / .parquet -> ArrayRecord shards + manifest -> the pipeline, end to end."""
import json

import numpy as np
import pytest

from moc_jax.config import data_config
from moc_jax.data import make_eval_batches, make_train_iterator
from moc_jax.errors import DataError
from moc_jax.data.prepare import main, prepare
from moc_jax.data.sources import read_manifest
from moc_jax.data.tokenizers import get_tokenizer

BYTE = get_tokenizer("byte")
TXT_DOCS = ["First paragraph,\nstill the first.", "Second one.", "Third, after two blank lines."]
JSONL_DOCS = ["json doc one", "json doc ünïcode"]
PARQUET_DOCS = ["parquet row one", "parquet row two", "parquet row three"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  import pyarrow as pa
  import pyarrow.parquet as pq
  root = tmp_path_factory.mktemp("inputs")
  (root / "a.txt").write_bytes(
      b"First paragraph,\nstill the first.\n\nSecond one.\n \n\n\xff\xfe broken\n\nThird, after two blank lines.\n\n")
  lines = [json.dumps({"text": JSONL_DOCS[0]}), "{broken json", json.dumps({"title": "no text"}),
           json.dumps({"text": 7}), json.dumps({"text": "   "}), "", json.dumps({"text": JSONL_DOCS[1]})]
  (root / "b.jsonl").write_text("\n".join(lines) + "\n")
  pq.write_table(pa.table({"text": [PARQUET_DOCS[0], None, PARQUET_DOCS[1], "", PARQUET_DOCS[2]]}),
                 root / "c.parquet")
  return root


def _config(directory, **overrides):
  c = data_config()
  c.name, c.layout, c.seq_len, c.batch_size, c.shuffle = f"arrayrecord:{directory}", "pad_truncate", 48, 3, False
  c.update(overrides)
  return c


def _texts(batches):
  return [BYTE.decode(r[m.astype(bool)]) for b in batches for r, m in zip(b["input_ids"], b["attention_mask"])]


def test_txt_jsonl_parquet_end_to_end(inputs, tmp_path):
  out = tmp_path / "ar"
  entry = prepare([str(inputs / "a.txt"), str(inputs / "*.jsonl"), str(inputs / "c.parquet")], str(out), "byte",
                  split="validation", shard_size=3)
  docs = TXT_DOCS + JSONL_DOCS + PARQUET_DOCS
  assert entry["documents"] == len(docs) and entry["malformed"] == 1 + 4 + 2
  assert entry["tokens"] == sum(len(d.encode()) for d in docs)
  assert entry["files"] == [f"validation-0000{i}.array_record" for i in range(3)]
  manifest = read_manifest(str(out))
  assert (manifest["tokenizer"], manifest["vocab_size"], manifest["dtype"]) == ("byte", 260, "<u2")
  batches = list(make_eval_batches(_config(out)))
  assert _texts(batches)[:len(docs)] == docs and sum(int(b["n_malformed"]) for b in batches) == 0


def test_txt_unit_file_and_cli(tmp_path, capsys):
  (tmp_path / "one.txt").write_text("Para A.\n\nPara B.\n")
  (tmp_path / "two.txt").write_text("Whole file.\n")
  main(["--input", str(tmp_path / "one.txt"), "--input", str(tmp_path / "t*.txt"), "--output", str(tmp_path / "ar"),
        "--tokenizer", "byte", "--txt_unit", "file", "--split", "validation"])
  assert "2 documents" in capsys.readouterr().out
  assert _texts(list(make_eval_batches(_config(tmp_path / "ar"))))[:2] == ["Para A.\n\nPara B.", "Whole file."]


@pytest.mark.parametrize("argv, error", [
    (["--input", "{tmp}/*.csv", "--output", "{tmp}/x"], "error: --input"),
    (["--input", "{tmp}/one.txt", "{tmp}/two.txt", "--output", "{tmp}/x"], "error: not a flag: {tmp}/two.txt"),
    (["--input", "{tmp}/one.txt", "--output", "{tmp}/x", "--txt_unit", "line"], "error: flag --txt_unit=line"),
    (["--input", "{tmp}/one.txt"], "error: flag --output=None")])
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, error):
  """As every command: one `error:` line and exit code 2, nothing written; several inputs repeat --input."""
  (tmp_path / "one.txt").write_text("Para A.\n")
  (tmp_path / "two.txt").write_text("Para B.\n")
  with pytest.raises(SystemExit) as exit_info:
    main([arg.format(tmp=tmp_path) for arg in argv])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.startswith(error.format(tmp=tmp_path)) and err.count("\n") == 1, err
  assert not (tmp_path / "x").exists()


def test_train_split_feeds_the_train_iterator(inputs, tmp_path):
  prepare([str(inputs / "c.parquet")], str(tmp_path / "ar"), "byte")
  batch = next(make_train_iterator(_config(tmp_path / "ar", layout="pack", seq_len=32, batch_size=2)))
  assert batch["input_ids"].shape == (2, 32) and (batch["attention_mask"] == 1).all()
  stream = "".join("|" if t == BYTE.eos_id else chr(t) for t in batch["input_ids"].ravel())
  assert any(f"|{doc}|" in stream for doc in PARQUET_DOCS)


def test_tokenizer_mismatch_and_missing_split(inputs, tmp_path, hf_path):
  out = tmp_path / "ar"
  prepare([str(inputs / "b.jsonl")], str(out), "byte")
  with pytest.raises(DataError) as e:
    make_train_iterator(_config(out, tokenizer=f"hf:{hf_path}"))
  assert "'byte'" in str(e.value) and hf_path in str(e.value)
  with pytest.raises(DataError, match="--split validation"):
    make_eval_batches(_config(out))
  with pytest.raises(DataError, match="another directory"):
    prepare([str(inputs / "b.jsonl")], str(out), f"hf:{hf_path}", split="validation")


def test_hf_tokenizer_records_round_trip(inputs, tmp_path, hf_path):
  tok = get_tokenizer(f"hf:{hf_path}")
  prepare([str(inputs / "c.parquet")], str(tmp_path / "ar"), f"hf:{hf_path}", split="validation")
  batches = list(make_eval_batches(_config(tmp_path / "ar", tokenizer=f"hf:{hf_path}")))
  rows = [r[m.astype(bool)] for b in batches for r, m in zip(b["input_ids"], b["attention_mask"])]
  assert [tok.decode(r) for r in rows[:3]] == PARQUET_DOCS
  assert all(np.array_equal(r, tok.encode(d)) for r, d in zip(rows, PARQUET_DOCS))


def _files(directory):
  return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize("name, content, error", [
    ("empty.txt", b"", "empty.txt: no valid document"),
    ("blank.jsonl", b'{"title": 1}\n{broken\n', "blank.jsonl: no valid document"),
    ("binary.txt", b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\n\nmore", "binary.txt: NUL bytes"),
    ("binary.jsonl", b'{"text": "ok"}\n\x00\x01\x02\n', "binary.jsonl: NUL bytes")])
def test_bad_input_leaves_the_prepared_split_as_it_was(inputs, tmp_path, capsys, name, content, error):
  """A run refused for its input (empty, no valid record, binary) is one error line naming the file, exit 2,
  and the directory's shards and manifest keep their bytes; no staging directory is left behind."""
  out = tmp_path / "ar"
  prepare([str(inputs / "c.parquet")], str(out), "byte")
  before = _files(out)
  (tmp_path / name).write_bytes(content)
  with pytest.raises(SystemExit) as exit_info:
    main(["--input", str(tmp_path / name), "--output", str(out)])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.startswith(f"error: {tmp_path / name}") and error in err, err
  assert err.count("\n") == 1
  assert _files(out) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ar", name])


def test_malformed_records_are_named_by_file_and_line(tmp_path, capsys):
  """The first ten malformed .jsonl records are named by file and line, the rest counted."""
  lines = [json.dumps({"text": "good"})] + ["{broken"] * 12 + [json.dumps({"text": "also good"})]
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  main(["--input", str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "ar")])
  out = capsys.readouterr().out
  named = [line.strip() for line in out.splitlines() if "malformed:" in line]
  assert named == [f"malformed: {tmp_path / 'm.jsonl'}:{n}: invalid JSON or no text field 'text'" for n in range(2, 12)]
  assert "... and 2 more malformed" in out and "12 malformed skipped" in out


def test_a_long_document_is_split_into_records_of_max_doc_tokens(tmp_path):
  """A 25-byte document with --max_doc_tokens 10 becomes records of 10, 10 and 5 tokens that concatenate to it;
  the short one stays whole."""
  long_doc = "abcdefghijklmnopqrstuvwxy"
  (tmp_path / "d.txt").write_text(f"{long_doc}\n\nshort\n")
  entry = prepare([str(tmp_path / "d.txt")], str(tmp_path / "ar"), "byte", split="validation", max_doc_tokens=10)
  assert (entry["documents"], entry["records"], entry["split_documents"]) == (2, 4, 1)
  texts = _texts(list(make_eval_batches(_config(tmp_path / "ar"))))[:4]
  assert texts == [long_doc[:10], long_doc[10:20], long_doc[20:], "short"]
