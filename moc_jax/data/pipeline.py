"""Grain pipelines: a checkpointable, per-process train iterator and deterministic eval batches.

Batch format (numpy, per process, B = config.data.batch_size, L = config.data.seq_len):
  input_ids       int32 [B, L]  token ids; padding slots hold the tokenizer's pad id
  labels          int32 [B, L]  targets aligned with input_ids (the loss shifts: logits[:, t] predicts
                                labels[:, t + 1]); -100 where not scored (padding, prompts, document starts)
  attention_mask  int32 [B, L]  1 on real tokens
  segment_ids     int32 [B, L]  only pack layouts + pack_boundaries=segment: 0 padding, 1..n documents in the row
  positions       int32 [B, L]  only pack layouts + pack_boundaries=segment: position within the document piece
  n_malformed     int32 []      malformed records skipped just before the documents that start in this batch
                                (i.e. since the previous batch; the sum over batches is the total: add it up)
  cluster_path    int32 [B, L, levels]  only with data.cluster.k > 0: the path down the cluster tree of the document
                                each token belongs to (data/cluster_paths.py); -1 on padding, GENERIC_PATH where
                                the document reads the generic chapters (data.cluster.generic)
Layouts:
  pad_truncate  MoC-PT's layout (docs/mocpt_semantics.md): one document per row, truncated to L, right-padded, no
                BOS/EOS added, labels -100 on pads.
  pack          documents get a trailing EOS and are concatenated then split into rows of L (grain's
                ConcatThenSplit: no padding in training). `segment` keeps boundaries: attention must stay within
                a segment, and each document's first label is -100 (it would be predicted from another
                document); a document cut at a row end continues in the next row as a new segment (positions
                restart at 0). `eos` is plain causal LM over EOS-separated text, so no segment fields.
  pack_whole    as `pack` (EOS, segments or eos boundaries), but a document that fits a row is never split: documents
                go whole into rows by first fit (grain's FirstFitPackIterDataset, _PACK_BINS rows at a time) and the
                rest of each row is padded. A document longer than a row is cut into row-length pieces first, each
                packed as its own segment with its first label -100. Costs padding (about 16% of the slots on
                `tiny`'s moc_facts rows of 256); buys rows in which every short document is seen whole.
Cluster paths are per token, not per row: a packed row holds several documents and `pack` splits a document over
rows, so only a per-token path is right under every layout, and it rides through packing as one more sequence
feature, as the malformed count does. It is a function of the record alone, so the iterator's state needs nothing
new to restore it.
Malformed counting is exact and resumable: a skipped record's count rides on the first token of the next
valid document (an extra per-token feature that packing splits consistently), so the count lands in the batch
that holds that token, and the iterator state needs nothing beyond grain's own.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import grain
import numpy as np

from moc_jax.config.validate import validate_data
from moc_jax.errors import DataError
from moc_jax.data.chat import IGNORE
from moc_jax.data.cluster_paths import cluster_index, generic_paths, token_paths
from moc_jax.data.sources import open_source
from moc_jax.data.tokenizers import get_tokenizer

_SEQUENCE_FIELDS = ("input_ids", "labels", "n_malformed")
_DOCS_PER_CHUNK = 8
# Records read together: an ArrayRecord source reads a list of keys in one call for about what one key costs alone
# (on the 2-core AMD EPYC, beside two training runs: 1.06 ms for one record, 7.6 us a record in reads of 256 shuffled
# keys), and a read of one key at a time was most of the input pipeline of a small model's update.
_READ_BATCH = 64
# Batches of records the read threads keep ready: about the 500 records grain reads ahead by default.
_READ_AHEAD = 8
# The train iterator's state layout: 2 since records are read _READ_BATCH keys at a time (the keys' stage nests in a
# flat map); a state of another layout cannot be restored.
_STATE_VERSION = 2
# pack_whole: rows filled per first-fit round. More rows fill better (on `tiny`'s moc_facts at 256 tokens: 80% of
# the slots at 16 rows, 84% at 64) and cost only their buffers.
_PACK_BINS = 64


def _shuffle_seed(seed: int) -> int:
  # Grain shuffles epoch e with seed + e; hashing keeps runs with seeds s and s + 1 from sharing epochs.
  return int(np.random.SeedSequence([seed, 0x6D6F63]).generate_state(1)[0])


def _to_element(record, *, to_example, layout, boundaries, eos_id, seq_len, paths):
  """A record -> {'input_ids', 'labels'[, 'cluster_path']} int32 arrays, or None (malformed). `paths(ids, n)`: the
  per-token cluster paths [n, levels] of a document's n tokens, or None for no paths."""
  example = to_example(record)
  if example is None:
    return None
  doc, labels = example
  if layout == "pad_truncate":
    if (labels[seq_len:] != IGNORE).any() and not (labels[:seq_len] != IGNORE).any():
      _warn_unlabelled(seq_len)
    ids, labels = doc[:seq_len], labels[:seq_len]
  else:
    eos_label = eos_id if labels[-1] != IGNORE else IGNORE  # chat: stop after assistant text only
    ids, labels = np.append(doc, np.int32(eos_id)), np.append(labels, np.int32(eos_label))
    if boundaries == "segment":
      labels[0] = IGNORE
  element = {"input_ids": ids, "labels": labels}
  if paths is not None:
    element["cluster_path"] = paths(doc, len(ids))
  return element


@functools.cache
def _warn_unlabelled(seq_len):
  """Once per process: a row cut to seq_len kept none of its labelled tokens (a chat row whose answer lies past the
  cut), so it trains on nothing; a run of such rows logs a loss of 0."""
  logging.warning("moc_jax: a row cut to data.seq_len=%d tokens keeps none of its labelled tokens (e.g. a chat answer "
                  "past the cut): it trains on nothing; raise data.seq_len or shorten the rows", seq_len)


class _Stage(grain.IterDataset):
  """An IterDataset stage whose iterator is `make_iterator(parent_iterator)`."""

  def __init__(self, parent, make_iterator):
    super().__init__(parent)
    self._make_iterator = make_iterator

  def __iter__(self):
    return self._make_iterator(self._parent.__iter__())


class _CountMalformedIterator(grain.DatasetIterator):
  """Drops None records and puts their count on the first token of the next valid element.

  Between `next` calls no drop is pending, so the state is exactly the parent's.
  """

  def __init__(self, parent, *, limit, on_exhausted=None):
    super().__init__(parent)
    self._limit, self._on_exhausted = limit, on_exhausted

  def __next__(self):
    dropped = 0
    while True:
      try:
        element = next(self._parent)
      except StopIteration:
        if self._on_exhausted is not None:
          self._on_exhausted(dropped)
        raise
      if element is not None:
        break
      dropped += 1
      if dropped >= self._limit:
        raise DataError(f"{dropped} malformed records in a row (a whole pass over the data): nothing is usable")
    counts = np.zeros(len(element["input_ids"]), np.int32)
    counts[0] = dropped
    return {**element, "n_malformed": counts}

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(state)


class _VersionedStateIterator(grain.DatasetIterator):
  """Tags the train iterator's state with the pipeline's layout (_STATE_VERSION): a checkpoint written by a pipeline
  of another layout is refused with one DataError instead of restoring wrong rows or failing deep inside grain."""

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return {"pipeline": _STATE_VERSION, "state": self._parent.get_state()}

  def set_state(self, state):
    if not isinstance(state, dict) or state.get("pipeline") != _STATE_VERSION:
      raise DataError("the checkpoint's data-iterator state was written by an input pipeline of another layout (before "
                      f"version {_STATE_VERSION}: records read one key at a time): resume it with the moc_jax that "
                      "wrote it, or train into a new --workdir")
    self._parent.set_state(state["state"])


class _JsonStateIterator(grain.DatasetIterator):
  """Restores ConcatThenSplit states that went through JSON (grain.checkpoint): its slices must be tuples.

  Without this, a state saved with no remainder ((-1, -1) read back as [-1, -1]) restores to wrong rows.
  """

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    slices = {k: tuple(v) for k, v in state["remainder_slices"].items()}
    self._parent.set_state({**state, "remainder_slices": slices})


def _pad_truncate_row(element, *, seq_len, pad_id):
  n = len(element["input_ids"])
  input_ids = np.full(seq_len, pad_id, np.int32)
  labels = np.full(seq_len, IGNORE, np.int32)
  mask = np.zeros(seq_len, np.int32)
  input_ids[:n], labels[:n], mask[:n] = element["input_ids"], element["labels"], 1
  row = {"input_ids": input_ids, "labels": labels, "attention_mask": mask,
         "n_malformed": element["n_malformed"].sum(dtype=np.int32)}
  if "cluster_path" in element:
    row["cluster_path"] = np.full((seq_len, element["cluster_path"].shape[1]), -1, np.int32)
    row["cluster_path"][:n] = element["cluster_path"]
  return row


def _cluster_path(packed, real):
  """A packed row's per-token paths, -1 on padding (grain pads features with 0, a node's index)."""
  return np.where(real[:, None], packed["cluster_path"], -1).astype(np.int32)


def _concat_documents(elements):
  """Joins a few documents into one element (ConcatThenSplit costs ~0.3 ms per element, so feed it fewer)."""
  chunk = {k: np.concatenate([e[k] for e in elements]) for k in elements[0]}
  doc_start = np.zeros(len(chunk["input_ids"]), np.int32)
  doc_start[np.cumsum([0] + [len(e["input_ids"]) for e in elements[:-1]])] = 1
  chunk["doc_start"] = doc_start
  return chunk


def _packed_row(packed, *, pad_id, segments):
  real = packed["input_ids_segment_ids"] > 0
  row = {"input_ids": np.where(real, packed["input_ids"], pad_id).astype(np.int32),
         "labels": np.where(real, packed["labels"], IGNORE).astype(np.int32),
         "attention_mask": real.astype(np.int32),
         "n_malformed": packed["n_malformed"].sum(dtype=np.int32)}
  if "cluster_path" in packed:
    row["cluster_path"] = _cluster_path(packed, real)
  if segments:  # a new segment at each document start and at the row start (a continued document)
    index = np.arange(len(real))
    first = (packed["doc_start"] == 1) | (index == 0)
    row["segment_ids"] = (np.cumsum(first) * real).astype(np.int32)
    row["positions"] = ((index - np.maximum.accumulate(np.where(first, index, 0))) * real).astype(np.int32)
  return row


class _RowPieces(grain.experimental.FlatMapTransform):
  """pack_whole: a document longer than a row -> row-length pieces; a continued piece's first label is not
  scored (it would be predicted from whatever precedes it in its row)."""

  max_fan_out = 1 << 20  # only the map-style flat map enforces it; a document may be any length

  def __init__(self, seq_len):
    self.seq_len = seq_len

  def flat_map(self, element):
    n = len(element["input_ids"])
    if n <= self.seq_len:
      return [element]
    pieces = [{k: v[i:i + self.seq_len] for k, v in element.items()} for i in range(0, n, self.seq_len)]
    for piece in pieces[1:]:
      piece["labels"] = piece["labels"].copy()
      piece["labels"][0] = IGNORE
    return pieces


def _whole_row(packed, *, pad_id, segments):
  """A first-fit row: grain numbers the documents (segment ids from 1, 0 on padding) and their positions."""
  seg = packed["input_ids_segment_ids"]
  real = seg > 0
  row = {"input_ids": np.where(real, packed["input_ids"], pad_id).astype(np.int32),
         "labels": np.where(real, packed["labels"], IGNORE).astype(np.int32),
         "attention_mask": real.astype(np.int32),
         "n_malformed": packed["n_malformed"].sum(dtype=np.int32)}
  if "cluster_path" in packed:
    row["cluster_path"] = _cluster_path(packed, real)
  if segments:
    row["segment_ids"] = seg.astype(np.int32)
    row["positions"] = (packed["input_ids_positions"] * real).astype(np.int32)
  return row


def _stack(rows):
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["n_malformed"] = np.asarray(batch["n_malformed"].sum(), np.int32)
  return batch


def _batches(ds, c, tokenizer, *, drop_remainder):
  """Valid elements (IterDataset) -> rows in the configured layout -> batches."""
  segments = c.pack_boundaries == "segment"
  fields = (*_SEQUENCE_FIELDS, "cluster_path") if c.cluster.k else _SEQUENCE_FIELDS
  if c.layout == "pad_truncate":
    ds = ds.map(lambda e: _pad_truncate_row(e, seq_len=c.seq_len, pad_id=tokenizer.pad_id))
  elif c.layout == "pack_whole":
    ds = grain.experimental.FlatMapIterDataset(ds, _RowPieces(c.seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: c.seq_len for k in fields}, num_packing_bins=_PACK_BINS, shuffle_bins=False)
    ds = ds.map(lambda p: _whole_row(p, pad_id=tokenizer.pad_id, segments=segments))
  else:
    ds = ds.batch(_DOCS_PER_CHUNK, batch_fn=_concat_documents)
    ds = grain.experimental.ConcatThenSplitIterDataset(
        ds, length_struct={k: c.seq_len for k in (*fields, "doc_start")})
    ds = _Stage(ds, _JsonStateIterator)
    ds = ds.map(lambda p: _packed_row(p, pad_id=tokenizer.pad_id, segments=segments))
  return ds.batch(c.batch_size, drop_remainder=drop_remainder, batch_fn=_stack)


def _read(records, keys):
  """The records at `keys`, in one batched read where the source has one (ArrayRecord, TFDS), else one by one."""
  if hasattr(records, "__getitems__"):
    return records.__getitems__(keys)
  return [records[k] for k in keys]


class _Unbatch(grain.experimental.FlatMapTransform):
  """A batch of elements back into elements, one by one (None, a malformed record, included)."""

  max_fan_out = _READ_BATCH

  def flat_map(self, elements):
    return elements


def _elements(c, split, tokenizer, *, process_index=0, process_count=1, train, paths="document"):
  """(IterDataset of elements-or-None, number of records per pass for this process). `paths`: the cluster paths'
  mode (cluster_paths.PATH_MODES) when data.cluster.k > 0.

  The shuffle, repeat and per-process slice act on record keys; the records are read _READ_BATCH keys at a time and
  the elements flattened back, so the stream holds the same elements in the same order as a read per key would."""
  index = cluster_index(c, tokenizer)  # fitted (or read) before the split is opened: a missing one is named first
  records, to_example = open_source(c, split, tokenizer)
  if not len(records):
    raise DataError(f"{c.name!r} split {split!r} has no records")
  keys = grain.MapDataset.range(len(records))
  if train:
    if c.shuffle:
      keys = keys.shuffle(seed=_shuffle_seed(c.seed))
    keys = keys.repeat(None)[process_index::process_count]
  path_fn = None if index is None else (lambda ids, n: token_paths(index, ids, n, tokenizer.decode, paths))
  element = functools.partial(_to_element, to_example=to_example, layout=c.layout, boundaries=c.pack_boundaries,
                              eos_id=tokenizer.eos_id, seq_len=c.seq_len, paths=path_fn)
  ds = keys.batch(_READ_BATCH, batch_fn=list).map(lambda batch: [element(r) for r in _read(records, batch)])
  if train and index is not None and c.cluster.generic:
    coin = functools.partial(generic_paths, probability=c.cluster.generic, seed=c.seed,
                             process_index=process_index, process_count=process_count)
    ds = ds.map_with_index(lambda i, batch: [coin(i * _READ_BATCH + j, e) for j, e in enumerate(batch)])
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=c.num_threads, prefetch_buffer_size=_READ_AHEAD))
  return grain.experimental.FlatMapIterDataset(it, _Unbatch()), -(-len(records) // process_count)


def make_train_iterator(config_data, *, process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
  """Endless, checkpointable iterator of this process's batches (format in the module docstring).

  Deterministic in config_data.seed; process p reads records p, p + P, ... of the shuffled, repeated stream,
  so processes see disjoint records. Save/restore with `get_state`/`set_state` or Orbax's
  `grain.checkpoint.CheckpointSave/CheckpointRestore`.
  """
  validate_data(config_data)
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index {process_index} is outside [0, {process_count})")
  tokenizer = get_tokenizer(config_data.tokenizer)
  it, per_pass = _elements(config_data, "train", tokenizer, process_index=process_index,
                           process_count=process_count, train=True)
  it = _Stage(it, lambda parent: _CountMalformedIterator(parent, limit=per_pass))
  it = _batches(it, config_data, tokenizer, drop_remainder=True)
  if config_data.prefetch:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=config_data.prefetch)
  return iter(_Stage(it, _VersionedStateIterator))


def _pad_batch(batch, batch_size, pad_id):
  """Fills a last partial batch with fully masked rows (pad ids, labels -100, mask 0)."""
  missing = batch_size - len(batch["input_ids"])
  if missing == 0:
    return batch
  fill = {"input_ids": pad_id, "labels": IGNORE, "cluster_path": -1}
  return {k: v if k == "n_malformed" else
          np.concatenate([v, np.full((missing, *v.shape[1:]), fill.get(k, 0), v.dtype)]) for k, v in batch.items()}


def make_eval_batches(config_data, split: str = "validation", max_batches: int | None = None,
                      paths: str = "document") -> Iterator[dict]:
  """Every record of `split`, in order, as batches of the same format (the last one padded with masked rows).

  A fresh, deterministic pass per call (an iterator, so large splits are never held in memory). Identical on
  every process: shard rows yourself if needed. Malformed records after the last valid one are added to the
  last batch's n_malformed. Errors (missing split, bad config) are raised here, not on the first `next`.
  `paths="prefix"` gives each token the cluster path of its document up to it (cluster_paths.token_paths).
  """
  validate_data(config_data)
  tokenizer = get_tokenizer(config_data.tokenizer)
  it, per_pass = _elements(config_data, split, tokenizer, train=False, paths=paths)
  trailing = []
  it = _Stage(it, lambda parent: _CountMalformedIterator(parent, limit=per_pass, on_exhausted=trailing.append))
  it = _batches(it, config_data, tokenizer, drop_remainder=False)
  return _padded_batches(iter(it), trailing, config_data.batch_size, tokenizer.pad_id, max_batches)


def _padded_batches(iterator, trailing, batch_size, pad_id, max_batches):
  """Yields padded batches one behind the source, so the trailing malformed count can join the last one."""
  previous, count = None, 0
  try:
    for batch in iterator:
      if previous is not None:
        yield previous
      previous, count = _pad_batch(batch, batch_size, pad_id), count + 1
      if max_batches is not None and count >= max_batches:
        break
    if previous is not None:
      if trailing:
        previous["n_malformed"] = np.asarray(previous["n_malformed"] + trailing[0], np.int32)
      yield previous
  finally:
    iterator.close()


def _str(value):
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_probes(config_data) -> list[dict]:
  """moc_facts probes: {prompt, answer, candidates, entity, entity_rank, doc_count, attribute} (str / int).

  Score a candidate by the log-likelihood of " " + candidate after the prompt.
  """
  if config_data.name != "moc_facts":
    raise DataError(f"probes exist only for config.data.name='moc_facts', not {config_data.name!r}")
  records, _ = open_source(config_data, "probes", get_tokenizer(config_data.tokenizer))
  return [{"prompt": _str(r["prompt"]), "answer": _str(r["answer"]),
           "candidates": [_str(v) for v in r["candidates"]], "entity": _str(r["entity"]),
           "entity_rank": int(r["entity_rank"]), "doc_count": int(r["doc_count"]),
           "attribute": _str(r["attribute"])} for r in records.__getitems__(range(len(records)))]
