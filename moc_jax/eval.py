"""Fact recall on moc_facts probes: log-likelihood choice among candidates and greedy exact match.

Choice scoring follows MoC-PT's MCQ harness: each row is prompt + continuation, right-padded, scored by
the mean log-likelihood of the continuation tokens (length-normalised); the argmax candidate wins.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moc_jax.losses import IGNORE, next_token_nll_rows
from moc_jax.sharding import constrain

ROW_MULTIPLE = 16  # pad lengths to a multiple of this so a few shapes cover all probes (few recompiles)


def _continuation(prompt: str, text: str) -> str:
  return text if prompt.endswith((" ", "\n")) else " " + text


def _pad_rows(rows, pad_id, multiple=ROW_MULTIPLE):
  width = -(-max(len(r) for r in rows) // multiple) * multiple
  ids = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)], mask[i, :len(r)] = r, 1
  return ids, mask


HEAD_DOCS = 10  # a fact is "head" if its entity has at least this many training documents


def _everywhere(x):
  """Replicated on the mesh, so every process of a multi-host run can read the result."""
  return constrain(x, *([None] * x.ndim))


def select_probes(probes, n, seed):
  """A fixed random sample of probes whose entity occurs in training (unseen facts cannot be recalled)."""
  seen = [p for p in probes if p["doc_count"] > 0]
  order = np.random.default_rng(seed).permutation(len(seen))[:n]
  return [seen[i] for i in sorted(order)]


class ProbeEvaluator:
  """Scores a fixed list of probes with the current params (jitted; shapes fixed per run)."""

  def __init__(self, graphdef, probes, tokenizer, batch_rows: int = 64):
    self.graphdef, self.tok = graphdef, tokenizer
    self.probes = probes
    self.num_candidates = len(probes[0]["candidates"])
    rows, labels = [], []
    for p in probes:
      prompt = tokenizer.encode(p["prompt"])
      for cand in p["candidates"]:
        cont = tokenizer.encode(_continuation(p["prompt"], cand))
        rows.append(prompt + cont)
        labels.append([IGNORE] * len(prompt) + cont)
    self.ids, self.mask = _pad_rows(rows, tokenizer.pad_id)
    self.labels = np.full_like(self.ids, IGNORE)
    for i, lab in enumerate(labels):
      self.labels[i, :len(lab)] = lab
    self.answer_index = np.array([p["candidates"].index(p["answer"]) for p in probes])
    self.prompts = [tokenizer.encode(p["prompt"]) for p in probes]
    self.answers = [tokenizer.encode(_continuation(p["prompt"], p["answer"])) for p in probes]
    self.gen_ids, self.gen_mask = _pad_rows([p + [tokenizer.pad_id] * len(a) for p, a in
                                             zip(self.prompts, self.answers)], tokenizer.pad_id)
    self.gen_mask[:] = 0
    for i, p in enumerate(self.prompts):
      self.gen_mask[i, :len(p)] = 1
    self.num_new = max(len(a) for a in self.answers)
    self.score_rows, self.gen_rows = min(batch_rows, len(self.ids)), min(batch_rows, len(probes))

    @jax.jit
    def score(params, ids, mask, labels):
      logits, _ = nnx.merge(graphdef, params)(ids, mask, train=False)
      nll, count = next_token_nll_rows(logits, labels)
      return _everywhere(-nll / jnp.maximum(count, 1))

    @functools.partial(jax.jit, static_argnums=4)
    def greedy(params, ids, mask, starts, num_new):
      model = nnx.merge(graphdef, params)
      rows = jnp.arange(ids.shape[0])

      def body(i, carry):
        ids, mask = carry
        logits, _ = model(ids, mask, train=False)
        pos = starts + i
        nxt = jnp.argmax(logits[rows, pos - 1], axis=-1).astype(ids.dtype)
        return ids.at[rows, pos].set(nxt), mask.at[rows, pos].set(1)
      ids, _ = jax.lax.fori_loop(0, num_new, body, (ids, mask))
      return _everywhere(ids)

    self._score, self._greedy = score, greedy

  def _chunks(self, n, size):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]

  def __call__(self, params) -> dict:
    scores = np.concatenate([
        np.asarray(self._score(params, *self._padded(s, self.score_rows, self.ids, self.mask, self.labels)))
        [:s.stop - s.start] for s in self._chunks(len(self.ids), self.score_rows)])
    choice = scores.reshape(len(self.probes), self.num_candidates).argmax(-1)
    starts = np.array([len(p) for p in self.prompts], np.int32)
    exact = []
    for s in self._chunks(len(self.probes), self.gen_rows):
      ids, mask, st = self._padded(s, self.gen_rows, self.gen_ids, self.gen_mask, starts)
      out = np.asarray(self._greedy(params, ids, mask, st, self.num_new))
      for j, i in enumerate(range(s.start, s.stop)):
        a = self.answers[i]
        exact.append(out[j, starts[i]:starts[i] + len(a)].tolist() == a)
    correct = choice == self.answer_index
    head = np.array([p["doc_count"] >= HEAD_DOCS for p in self.probes])
    out = {"probe_acc": float(np.mean(correct)), "probe_exact": float(np.mean(exact)),
           "probe_chance": 1.0 / self.num_candidates, "num_probes": len(self.probes)}
    for name, sel in (("head", head), ("tail", ~head)):  # frequent vs long-tail entities
      if sel.any():
        out[f"probe_acc_{name}"] = float(np.mean(correct[sel]))
    return out

  def _padded(self, s, rows, *arrays):
    """Pads a chunk to `rows` rows (repeating its first row) so every call has one shape."""
    out = []
    for a in arrays:
      chunk = a[s]
      extra = rows - len(chunk)
      out.append(np.concatenate([chunk, np.repeat(chunk[:1], extra, axis=0)]) if extra else chunk)
    return out
