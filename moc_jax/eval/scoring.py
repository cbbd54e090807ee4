"""Log-likelihood of continuations after contexts: the one scoring path of fact recall and MCQ benchmarks.

Each row is context + continuation, right-padded to one width for the whole set (sequence routing pools
over pads, as MoC-PT, so a row's score depends on that width and nothing else), scored by the sum of
the continuation tokens' log-probabilities. Rows run in fixed-size chunks, so one compiled program
serves every chunk.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from moc_jax.losses import IGNORE, next_token_nll_rows
from moc_jax.sharding import constrain, current

ROW_MULTIPLE = 16  # pad lengths to a multiple of this so a few shapes cover all rows (few recompiles)


def continuation(prompt: str, text: str) -> str:
  """`text` as it follows `prompt`: after one space unless the prompt already ends in whitespace."""
  return text if prompt.endswith((" ", "\n")) else " " + text


def pad_rows(rows, pad_id, multiple=ROW_MULTIPLE):
  """(ids, mask) [N, W]: rows right-padded to the longest one rounded up to `multiple`."""
  width = -(-max(len(r) for r in rows) // multiple) * multiple
  ids = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)], mask[i, :len(r)] = r, 1
  return ids, mask


def everywhere(x):
  """Replicated on the mesh, so every process of a multi-host run can read the result."""
  return constrain(x, *([None] * x.ndim))


def stderr(p: float, n: int) -> float:
  """Standard error of an accuracy p measured on n items: sqrt(p(1-p)/n)."""
  return math.sqrt(p * (1.0 - p) / n) if n else float("nan")


def chunk_rows(n: int, batch_rows: int) -> int:
  """Rows per call for n rows: a power of two (so sets of different sizes share compiled programs) up to
  `batch_rows`, rounded up to a multiple of the devices splitting the batch (the model pins activations
  to that split, which needs a divisible row count)."""
  axes, mesh = current("batch")
  split = math.prod(mesh.shape[a] for a in axes) if axes else 1
  return -(-min(batch_rows, 1 << (max(n, 1) - 1).bit_length()) // split) * split


def in_chunks(fn, rows: int, *arrays):
  """fn(*chunk) over consecutive `rows`-row chunks of `arrays` (the last one padded by repeating its first
  row, so every call has one shape); outputs (pytrees of arrays with rows first) concatenated, padding dropped."""
  outs = []
  for start in range(0, len(arrays[0]), rows):
    chunk = [a[start:start + rows] for a in arrays]
    n = len(chunk[0])
    if n < rows:
      chunk = [np.concatenate([c, np.repeat(c[:1], rows - n, axis=0)]) for c in chunk]
    outs.append(jax.tree.map(lambda o, n=n: np.asarray(o)[:n], fn(*chunk)))
  return jax.tree.map(lambda *xs: np.concatenate(xs), *outs)


class Rows(NamedTuple):
  """Scoring rows: ids / mask / labels [N, W] (labels IGNORE outside the continuation)."""
  ids: np.ndarray
  mask: np.ndarray
  labels: np.ndarray
  truncated: int  # rows whose context lost its first tokens to fit max_len
  paths: np.ndarray | None = None  # [N, W, levels] the cluster path each position reads by (memory.routing=cluster)


def make_rows(pairs, pad_id: int, max_len: int | None = None) -> Rows:
  """Rows of (context ids, continuation ids) pairs; a row longer than `max_len` keeps its last max_len
  tokens (the context is cut from the left, as lm-eval-harness does)."""
  rows, labels, truncated = [], [], 0
  for context, cont in pairs:
    row, lab = list(context) + list(cont), [IGNORE] * len(context) + list(cont)
    if max_len and len(row) > max_len:
      row, lab, truncated = row[-max_len:], lab[-max_len:], truncated + 1
    rows.append(row)
    labels.append(lab)
  ids, mask = pad_rows(rows, pad_id)
  label_arr = np.full_like(ids, IGNORE)
  for i, lab in enumerate(labels):
    label_arr[i, :len(lab)] = lab
  return Rows(ids, mask, label_arr, truncated)


class Scorer:
  """(sum of continuation log-probabilities [N] float32, continuation tokens [N]) of `Rows` under params."""

  def __init__(self, graphdef, batch_rows: int = 64):
    self.batch_rows = batch_rows

    @jax.jit
    def score(params, ids, mask, labels, paths=None):
      logits, _ = nnx.merge(graphdef, params)(ids, mask, cluster_path=paths, train=False)
      nll, count = next_token_nll_rows(logits, labels)
      return everywhere(-nll), everywhere(count)

    self._score = score

  def __call__(self, params, rows: Rows):
    fn = lambda *arrays: self._score(params, *arrays)  # noqa: E731
    arrays = (rows.ids, rows.mask, rows.labels) + (() if rows.paths is None else (rows.paths,))
    return in_chunks(fn, chunk_rows(len(rows.ids), self.batch_rows), *arrays)
