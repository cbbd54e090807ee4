"""Grain pipeline: batch format, layouts, determinism, resumption (incl. Orbax), sharding, malformed counting."""
import json

import numpy as np
import pytest

from moc_jax.config import data_config
from moc_jax.data import make_eval_batches, make_train_iterator
from moc_jax.data.facts import facts_builder
from moc_jax.data.prepare import prepare
from moc_jax.data.sources import MANIFEST, text_example
from moc_jax.data.tokenizers import get_tokenizer
from moc_jax.errors import DataError

BYTE = get_tokenizer("byte")
from tests.data.conftest import FACTS


def _config(data_dir, **overrides):
  c = data_config()
  c.facts.update(FACTS)
  c.data_dir, c.seq_len, c.batch_size = data_dir, 64, 4
  c.update(overrides)
  return c


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b):
  return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                  for x, y in zip(a, b))


def _docs(data_dir, split):
  """The split's documents as byte-token lists, in record order."""
  records = facts_builder(_config(data_dir).facts, data_dir).as_data_source(split)
  return [BYTE.encode(records[i]["text"].decode()) for i in range(len(records))]


@pytest.mark.parametrize("layout, boundaries, extra", [("pack", "segment", {"segment_ids", "positions"}),
                                                       ("pack", "eos", set()), ("pad_truncate", "segment", set()),
                                                       ("pack_whole", "segment", {"segment_ids", "positions"}),
                                                       ("pack_whole", "eos", set())])
def test_batch_format(data_dir, layout, boundaries, extra):
  batch = next(make_train_iterator(_config(data_dir, layout=layout, pack_boundaries=boundaries)))
  assert set(batch) == {"input_ids", "labels", "attention_mask", "n_malformed"} | extra
  for k, v in batch.items():
    assert v.dtype == np.int32 and v.shape == (() if k == "n_malformed" else (4, 64)), k


@pytest.mark.parametrize("layout", ["pack", "pack_whole", "pad_truncate"])
def test_deterministic_by_seed(data_dir, layout):
  a = _take(make_train_iterator(_config(data_dir, layout=layout)), 3)
  b = _take(make_train_iterator(_config(data_dir, layout=layout)), 3)
  c = _take(make_train_iterator(_config(data_dir, layout=layout, seed=1)), 3)
  assert _equal(a, b) and not _equal(a, c)


@pytest.mark.parametrize("layout, skip", [("pack", 3), ("pack", 0), ("pad_truncate", 5), ("pack_whole", 3),
                                          ("pack_whole", 17)])
def test_resume_mid_epoch_from_json_state(data_dir, layout, skip):
  c = _config(data_dir, layout=layout)
  it = make_train_iterator(c)
  _take(it, skip)
  state = json.loads(json.dumps(it.get_state()))  # what grain.checkpoint writes
  expected = _take(it, 4)
  resumed = make_train_iterator(c)
  resumed.set_state(state)
  assert _equal(_take(resumed, 4), expected)


def test_resume_through_orbax_checkpoint_manager(data_dir, tmp_path):
  import grain
  import orbax.checkpoint as ocp
  c = _config(data_dir)
  it = make_train_iterator(c)
  _take(it, 2)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data_iter",), options=options,
                             item_handlers={"data_iter": grain.checkpoint.CheckpointHandler()}) as mngr:
    mngr.save(2, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
  expected = _take(it, 3)
  resumed = make_train_iterator(c)
  with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data_iter",),
                             item_handlers={"data_iter": grain.checkpoint.CheckpointHandler()}) as mngr:
    mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(resumed)))
  assert _equal(_take(resumed, 3), expected)


def test_pad_truncate_matches_mocpt_layout(data_dir):
  c = _config(data_dir, layout="pad_truncate")
  batches = list(make_eval_batches(c))
  rows = {k: np.concatenate([b[k] for b in batches]) for k in ("input_ids", "labels", "attention_mask")}
  docs = _docs(data_dir, "validation")
  assert len(rows["input_ids"]) == 32  # 30 documents + 2 fully masked rows padding the last batch
  for i, doc in enumerate(docs):
    n = min(len(doc), 64)
    assert rows["input_ids"][i, :n].tolist() == doc[:n]  # truncated, no BOS/EOS
    assert rows["labels"][i, :n].tolist() == doc[:n]
    assert (rows["input_ids"][i, n:] == BYTE.pad_id).all() and (rows["labels"][i, n:] == -100).all()
    assert rows["attention_mask"][i].tolist() == [1] * n + [0] * (64 - n)
  assert (rows["attention_mask"][30:] == 0).all() and (rows["labels"][30:] == -100).all()


def test_pack_segments_positions_and_labels(data_dir):
  batches = list(make_eval_batches(_config(data_dir, layout="pack", pack_boundaries="segment")))
  stream, label_stream = [], []
  for b in batches:
    for ids, labels, seg, pos, mask in zip(b["input_ids"], b["labels"], b["segment_ids"], b["positions"],
                                           b["attention_mask"]):
      real = mask.astype(bool)
      assert (seg[real] >= 1).all() and (seg[~real] == 0).all() and (np.diff(seg[real]) >= 0).all()
      assert seg[0] in (0, 1) and (np.diff(seg[real]) <= 1).all()
      starts = np.flatnonzero(np.diff(seg, prepend=0) != 0)
      for s, e in zip(starts, list(starts[1:]) + [int(real.sum())]):
        assert pos[s:e].tolist() == list(range(e - s))  # positions restart in every segment
        if s > 0:
          assert labels[s] == -100  # a document's first token is not predicted from another document
      stream += ids[real].tolist()
      label_stream += labels[real].tolist()
  docs = _docs(data_dir, "validation")
  assert stream == [t for d in docs for t in d + [BYTE.eos_id]]  # every document once, in order, EOS-terminated
  assert label_stream == [t for d in docs for t in [-100] + d[1:] + [BYTE.eos_id]]


def _segments(batches):
  """(ids, labels, positions) of every segment of every row."""
  out = []
  for b in batches:
    for ids, labels, seg, pos in zip(b["input_ids"], b["labels"], b["segment_ids"], b["positions"]):
      out += [(ids[seg == s].tolist(), labels[seg == s].tolist(), pos[seg == s].tolist())
              for s in range(1, seg.max() + 1)]
  return out


def test_pack_whole_puts_every_document_whole_in_one_row(data_dir):
  batches = list(make_eval_batches(_config(data_dir, layout="pack_whole", seq_len=256)))
  docs = _docs(data_dir, "validation")
  assert max(len(d) for d in docs) < 256
  segments = _segments(batches)
  for ids, labels, pos in segments:
    assert labels == [-100] + ids[1:] and pos == list(range(len(ids)))
  assert sorted(ids for ids, _, _ in segments) == sorted(d + [BYTE.eos_id] for d in docs)  # each once, uncut
  for b in batches:  # padding only after the row's documents
    assert all(list(m) == sorted(m, reverse=True) for m in b["attention_mask"])
  real = sum(int(b["attention_mask"].sum()) for b in batches)
  assert real / (len(batches) * 4 * 256) > 0.6


def test_pack_whole_cuts_only_documents_longer_than_a_row(data_dir):
  batches = list(make_eval_batches(_config(data_dir, layout="pack_whole", seq_len=64)))
  docs = [d + [BYTE.eos_id] for d in _docs(data_dir, "validation")]
  assert min(len(d) for d in docs) > 64
  pieces = [d[i:i + 64] for d in docs for i in range(0, len(d), 64)]
  segments = _segments(batches)
  assert sorted(ids for ids, _, _ in segments) == sorted(pieces)
  for ids, labels, pos in segments:  # a continued piece's first token is not predicted from another document
    assert labels == [-100] + ids[1:] and pos == list(range(len(ids)))


def test_pack_eos_is_plain_causal(data_dir):
  batch = next(make_train_iterator(_config(data_dir, layout="pack", pack_boundaries="eos")))
  assert (batch["labels"] == batch["input_ids"]).all() and (batch["attention_mask"] == 1).all()
  assert (batch["input_ids"] == BYTE.eos_id).sum() >= 1


def test_eval_batches_are_deterministic_and_bounded(data_dir):
  c = _config(data_dir)
  a, b = list(make_eval_batches(c)), list(make_eval_batches(c))
  assert _equal(a, b) and _equal(list(make_eval_batches(c, max_batches=2)), a[:2])
  assert a[-1]["attention_mask"][-1].sum() == 0 and (a[-1]["labels"][-1] == -100).all()
  assert sum(int(x["n_malformed"]) for x in a) == 0


def test_tfds_name_reads_a_prepared_dataset(data_dir):
  config_name = facts_builder(_config(data_dir).facts, data_dir).builder_config.name
  c = _config(data_dir, layout="pad_truncate")
  via_tfds = _config(data_dir, layout="pad_truncate", name=f"tfds:moc_facts/{config_name}")
  assert _equal(list(make_eval_batches(via_tfds)), list(make_eval_batches(c)))


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
  """An ArrayRecord dataset of 50 distinct documents 'document number i.' plus corrupt records."""
  root = tmp_path_factory.mktemp("numbered")
  (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"document number {i}."}) + "\n" for i in range(50)))
  out = str(root / "ar")
  prepare([str(root / "docs.jsonl")], out, "byte")
  prepare([str(root / "docs.jsonl")], out, "byte", split="validation")
  return out


def _texts(batches):
  return [BYTE.decode(row[mask == 1]) for b in batches for row, mask in zip(b["input_ids"], b["attention_mask"])]


def test_processes_read_disjoint_records_covering_the_data(numbered, tmp_path):
  c = _config(str(tmp_path), name=f"arrayrecord:{numbered}", layout="pad_truncate", batch_size=5)
  seen = [_texts(_take(make_train_iterator(c, process_index=p, process_count=2), 5)) for p in range(2)]
  assert len(set(seen[0])) == len(set(seen[1])) == 25 and not set(seen[0]) & set(seen[1])
  assert set(seen[0]) | set(seen[1]) == {f"document number {i}." for i in range(50)}
  one = _texts(_take(make_train_iterator(c), 10))
  assert sorted(one) == sorted(seen[0] + seen[1])  # the two shards partition one process's epoch
  with pytest.raises(DataError, match="process_index"):
    make_train_iterator(c, process_index=2, process_count=2)


def test_records_come_in_the_shuffled_key_order_across_read_batches_and_epochs(numbered, tmp_path):
  """Records are read many keys at a time (pipeline._READ_BATCH); the stream must still be grain's shuffled,
  repeated, per-process key order, one record per key: 3 passes over 50 records cross read batches and epochs."""
  import grain

  from moc_jax.data import pipeline
  for process_index in range(2):
    c = _config(str(tmp_path), name=f"arrayrecord:{numbered}", layout="pad_truncate", batch_size=5, seed=7)
    keys = grain.MapDataset.range(50).shuffle(seed=pipeline._shuffle_seed(7)).repeat(None)[process_index::2]
    want = [f"document number {keys[i]}." for i in range(75)]
    assert _texts(_take(make_train_iterator(c, process_index=process_index, process_count=2), 15)) == want


def test_a_state_of_an_earlier_pipeline_layout_is_one_data_error(data_dir):
  """A checkpoint's iterator state from before records were read many keys a call (no layout tag: grain's own nesting,
  as that pipeline saved it) is refused by name, not restored to wrong rows."""
  it = make_train_iterator(_config(data_dir))
  earlier = {"parent": {"parent": {"next_index": 5}, "next_index_in_buffer": 0}, "next_row": 3, "counter": 3}
  with pytest.raises(DataError, match="another layout"):
    it.set_state(earlier)
  state = it.get_state()
  assert state["pipeline"] == 2
  it.set_state(state)  # its own state restores


def _record(text_or_ids):
  ids = BYTE.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
  return np.asarray(ids, "<u2").tobytes()


@pytest.fixture
def corrupt(numbered, tmp_path):
  """`numbered` plus a shard [valid, odd byte length, empty, out-of-vocab, valid, valid, out-of-vocab]."""
  import shutil

  from array_record.python.array_record_module import ArrayRecordWriter
  out = tmp_path / "ar"
  shutil.copytree(numbered, out)
  writer = ArrayRecordWriter(str(out / "validation-extra.array_record"), "group_size:1")
  for record in [_record("good A"), b"\x01\x02\x03", b"", _record([300]), _record("good B"), _record("good C"),
                 _record([999])]:
    writer.write(record)
  writer.close()
  manifest = json.loads((out / MANIFEST).read_text())
  manifest["splits"]["validation"]["files"] = ["validation-extra.array_record"]
  (out / MANIFEST).write_text(json.dumps(manifest))
  return str(out)


@pytest.mark.parametrize("layout", ["pack", "pad_truncate"])
def test_malformed_records_are_skipped_and_counted(corrupt, tmp_path, layout):
  c = _config(str(tmp_path), name=f"arrayrecord:{corrupt}", layout=layout, batch_size=1, shuffle=False)
  batches = list(make_eval_batches(c, split="validation"))
  assert sum(int(b["n_malformed"]) for b in batches) == 4
  assert "".join(_texts(batches)) == "good Agood Bgood C"  # EOS ids decode to nothing
  if layout == "pad_truncate":
    assert _texts(batches) == ["good A", "good B", "good C"]
    assert [int(b["n_malformed"]) for b in batches] == [0, 3, 1]  # the last one trails the final record


def test_train_counts_malformed_per_batch(corrupt, tmp_path):
  c = _config(str(tmp_path), name=f"arrayrecord:{corrupt}", layout="pad_truncate", batch_size=1, shuffle=False)
  manifest = json.loads(open(f"{corrupt}/{MANIFEST}").read())
  manifest["splits"]["train"] = manifest["splits"]["validation"]
  open(f"{corrupt}/{MANIFEST}", "w").write(json.dumps(manifest))
  batches = _take(make_train_iterator(c), 6)  # epoch 2 starts after the trailing corrupt record
  assert _texts(batches) == ["good A", "good B", "good C"] * 2
  assert [int(b["n_malformed"]) for b in batches] == [0, 3, 0, 1, 3, 0]


@pytest.mark.parametrize("record", [{"text": ""}, {"text": "  \n"}, {"text": b"\xff\xfe"}, {"other": "x"},
                                    {"text": 3}, {"text": None}, "not a dict"])
def test_malformed_text_records(record):
  assert text_example(record, field="text", tokenizer=BYTE) is None


def test_text_record_bytes_and_str():
  ids, labels = text_example({"text": "hé".encode()}, field="text", tokenizer=BYTE)
  assert ids.tolist() == labels.tolist() == [104, 0xC3, 0xA9] and ids.dtype == np.int32


@pytest.mark.parametrize("name, words", [
    ("tfds:lm1b", ["'lm1b'", "tfds build lm1b", "--file_format=array_record"]),
    ("tfds:no_such_dataset_xyz", ["no_such_dataset_xyz", "tfds build"]),
    ("arrayrecord:/nonexistent/dir", ["/nonexistent/dir", "python -m moc_jax.data.prepare", "--output /nonexistent"]),
    ("c4", ["'c4'", "moc_facts", "arrayrecord:<dir>"]),
])
def test_missing_dataset_is_one_clear_error(tmp_path, name, words):
  with pytest.raises(DataError) as e:
    make_train_iterator(_config(str(tmp_path), name=name))
  for w in words:
    assert w in str(e.value)


@pytest.mark.parametrize("field, value", [("layout", "ragged"), ("pack_boundaries", "none"), ("seq_len", 0),
                                          ("batch_size", -1), ("num_threads", -2), ("seed", -1),
                                          ("chat_format", "llama")])
def test_invalid_config_fields(data_dir, field, value):
  with pytest.raises(DataError, match=f"config.data.{field}"):
    make_train_iterator(_config(data_dir, **{field: value}))


def test_a_stream_read_in_order_gives_each_update_one_entity(tmp_path):
  """facts.order=stream, data.shuffle=False, one document a row: batch k holds entity k's documents, in order."""
  c = _config(str(tmp_path), layout="pad_truncate", shuffle=False, seq_len=256)
  c.facts.update(order="stream", num_docs=FACTS["num_entities"] * 4)
  names = [d["entity"] for d in facts_builder(c.facts, c.data_dir).as_data_source("train")]
  it = make_train_iterator(c)
  for k in range(5):
    batch = next(it)
    texts = [BYTE.decode([t for t in row if t < 256]) for row in batch["input_ids"]]
    entity = names[4 * k].decode()
    assert all(t.startswith(entity) or f" {entity}" in t for t in texts), (k, texts)
    assert names[4 * k: 4 * k + 4] == [entity.encode()] * 4


def test_a_warmup_read_in_order_comes_first(tmp_path):
  """facts.warmup_docs=24 of warmup_entities=3, data.shuffle=False, whole biographies one a row: the first 6 batches
  of 4 rows name only the first 3 entities (their names from the corpus, by rank), in the corpus's order."""
  c = _config(str(tmp_path), layout="pack_whole", shuffle=False, seq_len=256)
  c.facts.update(style="biography", zipf_a=0.0, num_docs=200, warmup_entities=3, warmup_docs=24)
  docs = list(facts_builder(c.facts, c.data_dir).as_data_source("train"))
  warm = {d["entity"].decode() for d in docs if d["entity_rank"] <= 3}
  it = make_train_iterator(c)
  texts = [BYTE.decode([t for t in row if t < 256]) for _ in range(7) for row in next(it)["input_ids"]]
  assert [t.split(":")[0] for t in texts[:24]] == [d["entity"].decode() for d in docs[:24]]
  assert {t.split(":")[0] for t in texts[:24]} == warm and len(warm) == 3
  assert not {t.split(":")[0] for t in texts[24:]} <= warm


def test_a_row_cut_before_all_its_labels_warns_once(caplog):
  """pad_truncate keeps the first seq_len tokens: a chat row whose answer lies past them trains on nothing, which the
  log says (once a process), and a row that keeps some of its labels says nothing."""
  from moc_jax.data import pipeline
  from moc_jax.data.chat import IGNORE
  pipeline._warn_unlabelled.cache_clear()
  ids = np.arange(10, dtype=np.int32)
  def element(labelled_from):
    labels = np.where(np.arange(10) >= labelled_from, ids, IGNORE).astype(np.int32)
    return pipeline._to_element(None, to_example=lambda _: (ids, labels), layout="pad_truncate", boundaries="none",
                                eos_id=0, seq_len=6, paths=None)
  with caplog.at_level("WARNING"):
    kept = element(5)
    assert not caplog.records and kept["labels"].tolist() == [IGNORE] * 5 + [5]
    cut = element(7)
    element(8)
  assert (cut["labels"] == IGNORE).all() and len(cut["input_ids"]) == 6
  assert [r.getMessage() for r in caplog.records] == [
      "moc_jax: a row cut to data.seq_len=6 tokens keeps none of its labelled tokens (e.g. a chat answer past the "
      "cut): it trains on nothing; raise data.seq_len or shorten the rows"]
