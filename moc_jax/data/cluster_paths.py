"""Each document's path down a fixed cluster tree of its corpus (`config.data.cluster`): what `memory.routing=cluster`
reads its chapters by (hierarchical memories, Pouransari et al.).

The tree (data/cluster_tree.py) and the idf of its embedding are fitted once on the training split (at most
FIT_DOCUMENTS of its documents), by one process at a time, and cached in `<data.data_dir>/cluster_trees/`, the file
named by the dataset and the tree's parameters, so every process and every later run traverses the same tree. A document's text is its token ids decoded, so every source (text, token records,
chat) and every split goes through the one traversal, and a probe's prompt is traversed as text.

Paths are per token (`token_paths`): `document` gives every token its whole document's path (training: the path then
tells a document's early positions something of its later tokens, at most levels·log2(k) bits); `prefix` gives token t
the path of the document's tokens up to t (causal: what evaluation reports beside it); `generic` puts every document
on the generic chapters (`data.cluster.generic`, which in training does so for a random share of the documents:
`generic_paths`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re

import numpy as np

from moc_jax.config.schema import GENERIC_PATH
from moc_jax.data.cache_lock import exclusive
from moc_jax.data.cluster_tree import Embedder, Tree, build_tree, first_words
from moc_jax.data.sources import data_dir, open_source, read_manifest
from moc_jax.errors import DataError

log = logging.getLogger("moc_jax")

PATH_MODES = ("document", "prefix", "generic")
_FORMAT = 1  # bump when the cached file's contents change meaning
FIT_DOCUMENTS = 1 << 18  # the most training documents a tree is fitted on (fit_documents); a corpus up to it: all


@dataclasses.dataclass(frozen=True)
class ClusterIndex:
  """A fitted embedding and the tree over it: texts -> their paths [n, levels] int32 (node index within each
  level). `words` > 0: a text is read by its first `words` words only (data.cluster.words), in fitting and
  traversal alike."""
  embedder: Embedder
  tree: Tree
  words: int = 0

  @property
  def levels(self) -> int:
    return self.tree.levels

  def __call__(self, texts) -> np.ndarray:
    return self.tree.paths(self.embedder(first_words(texts, self.words)))

  def save(self, path) -> None:
    """Written under a temporary name and renamed: processes building the same tree at once never read half a
    file."""
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, format=_FORMAT, first_words=self.words, **self.tree.arrays(), **self.embedder.arrays())
    os.replace(tmp, path)

  @classmethod
  def load(cls, path) -> ClusterIndex:
    with np.load(path) as f:  # a tree saved before data.cluster.words read whole texts
      return cls(Embedder.from_arrays(f), Tree.from_arrays(f), int(f["first_words"]) if "first_words" in f else 0)


def fit_index(texts, k: int, levels: int, seed: int, words: int = 0) -> ClusterIndex:
  read = first_words(texts, words)
  embedder = Embedder.fit(read)
  return ClusterIndex(embedder, build_tree(embedder(read), k, levels, seed), words)


def token_paths(index: ClusterIndex, ids, length: int, decode, mode: str) -> np.ndarray:
  """[length, levels] int32 paths for the tokens of an element made from document `ids` (`length` <= len(ids) + 1:
  the ids truncated, or the ids and an EOS). `document`: the whole document's path at every token; `prefix`: token t
  the path of ids[:t + 1] (an EOS past the ids takes the whole document's); `generic`: GENERIC_PATH at every token
  (the generic chapters of data.cluster.generic, whatever the document)."""
  if mode == "generic":
    return np.full((length, index.levels), GENERIC_PATH, np.int32)
  if mode == "document":
    return np.repeat(index([decode(ids)]), length, axis=0)
  paths = index([decode(ids[:t + 1]) for t in range(min(length, len(ids)))])
  return np.concatenate([paths, np.repeat(paths[-1:], length - len(paths), axis=0)])


def generic_paths(index: int, element, *, probability: float, seed: int, process_index: int, process_count: int):
  """Training's generic-memory control: with `probability`, an element's document reads the generic chapters (its
  paths become GENERIC_PATH). `index` is the element's place in this process's stream; the coin hashes the data seed
  with its place in the global stream, so a resumed run and any process count draw the same coins."""
  if element is None:
    return None
  coin = np.random.default_rng([seed, 0x67656E, index * process_count + process_index]).random()
  if coin >= probability:
    return element
  return {**element, "cluster_path": np.full_like(element["cluster_path"], GENERIC_PATH)}


def _dataset_identity(config_data, tokenizer) -> dict:
  """What decides the training split's texts: a cached tree is reused only for the same ones."""
  name = config_data.name
  kind, _, where = name.partition(":")
  out = {"format": _FORMAT, "name": name, "tokenizer": tokenizer.fingerprint}
  if name == "moc_facts":
    out["facts"] = config_data.facts.to_dict()
  elif kind == "tfds":
    out["text_field"] = config_data.text_field
  elif kind == "arrayrecord":
    directory = os.path.abspath(os.path.expanduser(where))
    splits = (read_manifest(directory) or {}).get("splits") or {}
    out.update(name=f"arrayrecord:{directory}", train=splits.get("train"))
  elif kind == "chat":
    path = os.path.abspath(os.path.expanduser(where.replace("{split}", "train")))
    stat = os.stat(path) if os.path.isfile(path) else None
    out.update(name=f"chat:{path}", chat_format=config_data.chat_format,
               file=None if stat is None else [stat.st_size, stat.st_mtime_ns])
  return out


def index_path(config_data, tokenizer) -> str:
  """Where the tree of `config_data` is cached: named by the dataset (readable, and a digest of what decides its
  training texts) and the tree's parameters."""
  c = config_data.cluster
  identity = json.dumps(_dataset_identity(config_data, tokenizer), sort_keys=True)
  digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
  slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", config_data.name).strip("_")[-40:]
  words = f"-w{c.words}" if c.words else ""  # a tree of whole texts keeps the name it always had
  return os.path.join(data_dir(config_data), "cluster_trees",
                      f"{slug}-k{c.k}-l{c.levels}-s{c.seed}{words}-{digest}.npz")


def _given_tree(c) -> ClusterIndex:
  """`data.cluster.tree`: the saved index it names, which must have the config's k and levels."""
  path = os.path.expanduser(c.tree)
  try:
    index = ClusterIndex.load(path)
  except (OSError, ValueError, KeyError) as e:
    raise DataError(f"config.data.cluster.tree={c.tree!r} is not a saved cluster tree ({type(e).__name__}) — "
                    "name a .npz of <data_dir>/cluster_trees/, or leave it None to fit one on this dataset") from None
  if (index.tree.k, index.levels, index.words) != (c.k, c.levels, c.words):
    raise DataError(f"config.data.cluster.tree={c.tree!r} is a tree of k={index.tree.k}, {index.levels} levels, "
                    f"words={index.words}, and the config asks k={c.k}, {c.levels}, words={c.words} — set "
                    "data.cluster.k, levels and words to the tree's")
  return index


def cluster_index(config_data, tokenizer) -> ClusterIndex | None:
  """The dataset's cluster index (loaded from the cache, or fitted on the training split and cached; or the tree
  `data.cluster.tree` names), or None when `data.cluster.k` is 0."""
  c = config_data.cluster
  if not c.k:
    return None
  if c.tree:
    return _given_tree(c)
  path = index_path(config_data, tokenizer)
  with exclusive(f"{path}.lock"):
    if os.path.isfile(path):
      return ClusterIndex.load(path)
    records, to_example = open_source(config_data, "train", tokenizer)
    examples = (to_example(records[i]) for i in fit_documents(len(records), c.seed))
    texts = [tokenizer.decode(example[0]) for example in examples if example is not None]
    index = fit_index(texts, c.k, c.levels, c.seed, c.words)
    index.save(path)
  log.warning("moc_jax: cluster tree (k=%d, %d levels) fitted on %d of %d training documents -> %s", c.k, c.levels,
              len(texts), len(records), path)
  return index


def fit_documents(n: int, seed: int) -> np.ndarray:
  """Which of the `n` training documents the tree is fitted on, in order: all of them up to FIT_DOCUMENTS, else a
  seeded sample of that many. Its EM reads cluster_tree.EM_SAMPLE documents of a node at each step anyway, so more
  documents would not make a better tree, only cost: the embeddings of 4.9M documents (float64 [n, 256]) take 10 GB.
  A corpus of at most FIT_DOCUMENTS is fitted on all of it, as before the cap: its cached trees stay valid."""
  if n <= FIT_DOCUMENTS:
    return np.arange(n)
  return np.sort(np.random.default_rng([seed, 0x66697421]).choice(n, FIT_DOCUMENTS, replace=False))
