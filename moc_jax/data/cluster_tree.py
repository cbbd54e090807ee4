"""A balanced k-means tree over document embeddings, and each document's path down it.

Hierarchical memories (Pouransari et al., "Pretraining with hierarchical memories: separating long-tail and common
knowledge") fetch a document's memory along its path in a fixed clustering of the corpus rather than by a learned
router: the path says what the document is about, where a router trained by the loss has been seen to follow the
text's template (docs/routing.md). The tree is built once, offline, from the root down: each node's documents are
split into k children by k-means (k-means++ start, EM on fresh samples of the node's documents, a balance rule),
and a document's path is a greedy descent to the nearest child centroid at each level, so the same traversal serves
training documents, prompts at evaluation and generation alike.

Embeddings need no download: hashed word TF-IDF, signed into `dim` buckets several times (a sparse random
projection), L2-normalised. Names and values are rare words with a high IDF, so documents about one entity land
together while the template's words weigh little.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from collections.abc import Sequence

import numpy as np

BALANCE = 1.5       # a cluster holding more than BALANCE / k of a sample's assignments is split (the paper's 1.5/16)
EM_STEPS = 20       # EM steps per node, each on a fresh sample (the paper's 20 x 6,400)
EM_SAMPLE = 6400
HASHES = 4          # buckets each word is signed into: collisions of two words in all of them are rare

_WORD = re.compile(r"\w+")


def first_words(texts: Sequence[str], words: int) -> Sequence[str]:
  """Each text cut to its first `words` words (the words the embedding reads), or `texts` as they are for 0."""
  if not words:
    return texts
  return [" ".join(_WORD.findall(t)[:words]) for t in texts]


@functools.lru_cache(maxsize=1 << 20)
def _word_hashes(word: str, dim: int) -> tuple[tuple[int, float], ...]:
  """(bucket, sign) pairs of one word, from a hash that is the same in every process (str.__hash__ is salted)."""
  digest = hashlib.blake2b(word.encode(), digest_size=4 * HASHES).digest()
  out = []
  for j in range(HASHES):
    h = int.from_bytes(digest[4 * j:4 * j + 4], "little")
    out.append((h % dim, 1.0 if h >> 31 else -1.0))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Embedder:
  """Hashed TF-IDF with one corpus's document frequencies: each lower-cased word weighs tf x idf, added with its
  signs into its HASHES buckets (scaled by 1/sqrt(HASHES), so a word alone has norm 1 before normalising), and the
  rows are L2-normalised. The idf is fitted once, so a text embedded later (a validation document, a probe's prompt)
  lands where the corpus's documents on its subject did; a word the corpus never had weighs 0, as it says nothing
  about where in the corpus a text belongs."""
  idf: dict[str, float]
  dim: int = 256

  @classmethod
  def fit(cls, texts: Sequence[str], dim: int = 256) -> Embedder:
    """idf = log(N / df) over `texts` (a word in every text weighs 0)."""
    df: dict[str, int] = {}
    for t in texts:
      for w in set(_WORD.findall(t.lower())):
        df[w] = df.get(w, 0) + 1
    return cls({w: math.log(len(texts) / n) for w, n in df.items()}, dim)

  def __call__(self, texts: Sequence[str]) -> np.ndarray:
    """[len(texts), dim] float32 unit vectors (zeros for a text with no word of weight)."""
    scale = 1 / math.sqrt(HASHES)
    out = np.zeros((len(texts), self.dim), np.float64)
    for i, t in enumerate(texts):
      for w in _WORD.findall(t.lower()):
        idf = self.idf.get(w, 0.0)
        if idf:
          for bucket, sign in _word_hashes(w, self.dim):
            out[i, bucket] += sign * idf * scale
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return (out / np.where(norms > 0, norms, 1)).astype(np.float32)

  def arrays(self) -> dict[str, np.ndarray]:
    """The embedder as named arrays (for np.savez beside a tree)."""
    return {"words": np.array(sorted(self.idf), dtype=str), "idf": np.array([self.idf[w] for w in sorted(self.idf)]),
            "dim": np.array(self.dim)}

  @classmethod
  def from_arrays(cls, f) -> Embedder:
    return cls(dict(zip(f["words"].tolist(), f["idf"].tolist())), int(f["dim"]))


def embed_texts(texts: Sequence[str], dim: int = 256) -> np.ndarray:
  """[len(texts), dim] float32 unit vectors of `texts` under their own idf (`Embedder.fit`)."""
  return Embedder.fit(texts, dim)(texts)


def nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
  """Index of each row's nearest centroid (L2; the lower index on a tie)."""
  d = (x * x).sum(1, keepdims=True) - 2 * x @ centroids.T + (centroids * centroids).sum(1)
  return np.argmin(d, axis=1)


def descend(x: np.ndarray, node: np.ndarray, centroids: np.ndarray, k: int) -> np.ndarray:
  """One level of the traversal: row i at node[i] of the level above moves to the nearest of that node's k children
  (centroids[node * k : node * k + k]); returns the children's indices within this level."""
  out = np.empty_like(node)
  for j in np.unique(node):
    rows = np.flatnonzero(node == j)
    out[rows] = j * k + nearest(x[rows], centroids[j * k:(j + 1) * k])
  return out


def kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
  """k-means++: the first centre uniform, each next drawn in proportion to its squared distance from the nearest
  centre so far. Needs len(x) >= k."""
  centres = [x[rng.integers(len(x))]]
  d2 = ((x - centres[0]) ** 2).sum(1)
  for _ in range(1, k):
    total = d2.sum()
    i = rng.choice(len(x), p=d2 / total) if total > 0 else rng.integers(len(x))
    centres.append(x[i])
    d2 = np.minimum(d2, ((x - x[i]) ** 2).sum(1))
  return np.stack(centres)


def balance(assign: np.ndarray, k: int, rng: np.random.Generator, bound: float = BALANCE) -> np.ndarray:
  """The balance rule: while some cluster holds more than bound / k of the assignments, the largest one's points and
  the smallest one's are shuffled together and shared between them, half each (the larger half to the largest).

  It ends: the largest cluster holds more than the mean, the smallest at most the mean, so each split lowers the sum
  of squared cluster sizes."""
  assign = assign.copy()
  limit = bound * len(assign) / k
  while True:
    counts = np.bincount(assign, minlength=k)
    big, small = int(np.argmax(counts)), int(np.argmin(counts))
    if counts[big] <= limit:
      return assign
    members = rng.permutation(np.flatnonzero((assign == big) | (assign == small)))
    half = (len(members) + 1) // 2
    assign[members[:half]], assign[members[half:]] = big, small


def fit_node(x: np.ndarray, k: int, rng: np.random.Generator, steps: int = EM_STEPS,
             sample: int = EM_SAMPLE) -> np.ndarray:
  """[k, dim] centroids splitting one node's points x: k-means++ on a sample, then `steps` EM steps, each assigning a
  fresh sample (all points when there are at most `sample`), balancing the assignment and moving each centroid to
  its points' mean (a centroid with no points stays). A node with fewer than k points gives each point a centroid of
  its own and repeats the last one: a repeated centroid never wins (nearest keeps the lower index on a tie)."""
  if len(x) <= k:
    return np.concatenate([x, np.repeat(x[-1:], k - len(x), axis=0)])

  def draw():
    return x if len(x) <= sample else x[rng.choice(len(x), sample, replace=False)]

  centroids = kmeans_pp(draw(), k, rng)
  for _ in range(steps):
    batch = draw()
    assign = balance(nearest(batch, centroids), k, rng)
    for c in range(k):
      members = batch[assign == c]
      if len(members):
        centroids[c] = members.mean(0)
  return centroids


@dataclasses.dataclass(frozen=True)
class Tree:
  """centroids[l] is level l+1's [k^(l+1), dim]: node j of a level has children j*k ... j*k + k - 1 below it."""
  k: int
  centroids: tuple[np.ndarray, ...]

  @property
  def levels(self) -> int:
    return len(self.centroids)

  def paths(self, x: np.ndarray) -> np.ndarray:
    """[n, levels] int32: at each level the index (within the level, 0 ... k^l - 1) of the nearest of the current
    node's k children: the greedy traversal, O(levels x k) distances per row."""
    node = np.zeros(len(x), np.int64)
    out = np.zeros((len(x), self.levels), np.int32)
    for level, centroids in enumerate(self.centroids):
      node = descend(x, node, centroids, self.k)
      out[:, level] = node
    return out

  def arrays(self) -> dict[str, np.ndarray]:
    """The tree as named arrays (np.savez)."""
    return {"k": np.array(self.k), **{f"level{level + 1}": c for level, c in enumerate(self.centroids)}}

  @classmethod
  def from_arrays(cls, f) -> Tree:
    levels = sum(name.startswith("level") for name in f)
    return cls(int(f["k"]), tuple(f[f"level{level + 1}"] for level in range(levels)))

  def save(self, path) -> None:
    np.savez(path, **self.arrays())

  @classmethod
  def load(cls, path) -> Tree:
    with np.load(path) as f:
      return cls.from_arrays(f)


def build_tree(x: np.ndarray, k: int, levels: int, seed: int = 0, steps: int = EM_STEPS,
               sample: int = EM_SAMPLE) -> Tree:
  """The tree from the root down: each node of a level is fit on the points the traversal sends to it (a node no
  point reaches repeats its parent's centroid), so a level's split is the one its own paths will follow."""
  rng = np.random.default_rng(seed)
  node = np.zeros(len(x), np.int64)
  parents = x.mean(0, keepdims=True)
  centroids = []
  for _ in range(levels):
    level = []
    for j in range(len(parents)):
      members = x[node == j]
      level.append(fit_node(members, k, rng, steps, sample) if len(members) else np.repeat(parents[j:j + 1], k, 0))
    level = np.concatenate(level).astype(np.float32)
    node = descend(x, node, level, k)
    centroids.append(level)
    parents = level
  return Tree(k, tuple(centroids))


def purity(labels: np.ndarray, clusters: np.ndarray) -> float:
  """The share of points whose cluster's most common label is their own."""
  table = _contingency(labels, clusters)
  return float(table.max(0).sum() / len(labels))


def nmi(labels: np.ndarray, clusters: np.ndarray) -> float:
  """Normalised mutual information I(L; C) / ((H(L) + H(C)) / 2), in [0, 1] (1 when the clusters are the labels)."""
  table = _contingency(labels, clusters) / len(labels)
  pl, pc = table.sum(1), table.sum(0)
  nz = table > 0
  mi = (table[nz] * np.log(table[nz] / np.outer(pl, pc)[nz])).sum()
  h = -(pl[pl > 0] * np.log(pl[pl > 0])).sum() - (pc[pc > 0] * np.log(pc[pc > 0])).sum()
  return float(2 * mi / h) if h > 0 else 1.0


def _contingency(labels, clusters) -> np.ndarray:
  """[distinct labels, distinct clusters] counts."""
  _, li = np.unique(labels, return_inverse=True)
  _, ci = np.unique(clusters, return_inverse=True)
  table = np.zeros((li.max() + 1, ci.max() + 1), np.int64)
  np.add.at(table, (li, ci), 1)
  return table
