"""Input pipelines: tokenizers, the embedded `moc_facts` corpus, Grain train/eval iterators, IFT chat rows.

Public API (batch format in `pipeline.py`): `default_data_config`, `make_train_iterator`,
`make_eval_batches`, `load_probes`, `get_tokenizer`, `DataError`. The heavy modules (grain, tfds) are
imported on first use so that configs can call `default_data_config()` cheaply.
"""
from __future__ import annotations

import importlib
import os

from ml_collections import config_dict

DEFAULT_DATA_DIR = "~/.cache/moc_jax/data"
DATA_DIR_ENV = "MOC_JAX_DATA_DIR"


class DataError(RuntimeError):
  """A dataset, split, file or tokenizer is missing or inconsistent; the message says how to fix it."""


def default_data_config() -> config_dict.ConfigDict:
  """Defaults for `config.data` (the tiny model's byte vocabulary, packed 256-token rows)."""
  c = config_dict.ConfigDict()
  c.name = "moc_facts"          # moc_facts | tfds:<name>[/config] | arrayrecord:<dir> | chat:<path.jsonl>
  c.data_dir = os.environ.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)
  c.tokenizer = "byte"          # byte | hf:<tokenizer.json> | sp:<model.model>
  c.layout = "pack"             # pack | pad_truncate (MoC-PT: one document per row, truncated, right-padded)
  c.pack_boundaries = "segment"  # segment (segment_ids + positions) | eos (EOS-separated, plain causal)
  c.seq_len = 256
  c.batch_size = 16             # per process, per micro-batch
  c.seed = 0
  c.shuffle = True
  c.num_threads = 2             # grain read threads
  c.prefetch = 2                # batches prepared ahead in a background thread (0: none)
  c.text_field = "text"
  c.chat_format = "plain"       # plain (MoC-PT's <|user|> fallback) | chatml

  f = c.facts = config_dict.ConfigDict()
  f.num_entities = 2000
  f.seed = 0
  f.zipf_a = 1.1
  f.num_docs = 20_000
  f.num_val_docs = 1000
  f.probes_per_fact = 1
  f.num_candidates = 4
  return c


_LAZY = {
    "make_train_iterator": "moc_jax.data.pipeline",
    "make_eval_batches": "moc_jax.data.pipeline",
    "load_probes": "moc_jax.data.pipeline",
    "get_tokenizer": "moc_jax.data.tokenizers",
}

__all__ = ["DataError", "default_data_config", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'moc_jax.data' has no attribute {name!r}")
