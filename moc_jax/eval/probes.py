"""Fact recall on moc_facts probes: log-likelihood choice among candidates and greedy exact match.

Choice scoring follows MoC-PT's MCQ harness: each row is prompt + continuation, right-padded, scored by
the mean log-likelihood of the continuation tokens (length-normalised); the argmax candidate wins.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moc_jax.config import reads_cluster_paths
from moc_jax.data.cluster_paths import cluster_index
from moc_jax.data.facts import entity_biographies
from moc_jax.eval.scoring import Scorer, chunk_rows, continuation, everywhere, in_chunks, make_rows, pad_rows, stderr

HEAD_DOCS = 10  # a fact is "head" if its entity has at least this many training documents
# Buckets of an entity's training documents for the long-tail breakdown: [1, 3), [3, 10), ..., [1000, inf).
DOC_BUCKET_EDGES = (1, 3, 10, 30, 100, 300, 1000)


def select_probes(probes, n, seed):
  """A fixed random sample of probes whose entity occurs in training (unseen facts cannot be recalled)."""
  seen = [p for p in probes if p["doc_count"] > 0]
  order = np.random.default_rng(seed).permutation(len(seen))[:n]
  return [seen[i] for i in sorted(order)]


def with_prompt_paths(config, probes, tokenizer):
  """`probes`, each with its prompt's cluster path ("cluster_path" [levels]) when the model reads by one
  (memory.routing=cluster): the prompt's alone, never the answer's, so a probe fetches what its question points at."""
  if not reads_cluster_paths(config):
    return probes
  paths = cluster_index(config.data, tokenizer)([p["prompt"] for p in probes])
  return [{**p, "cluster_path": path} for p, path in zip(probes, paths)]


def entity_paths(config, all_probes, tokenizer) -> dict[str, tuple[int, ...]]:
  """{entity: its path}: the path every training document about the entity took (a biography corpus's documents
  about one entity hold the same words: data.facts.entity_biographies)."""
  texts = entity_biographies(all_probes)
  names = sorted(texts)
  return dict(zip(names, map(tuple, cluster_index(config.data, tokenizer)([texts[name] for name in names]).tolist())))


def with_entity_paths(probes, paths):
  """`probes` each with its entity's path (`entity_paths`) instead of its prompt's. Recall on these is what the
  memory gives when the tree sends a question where it sent the documents on its subject, so against the prompts'
  recall it tells a router's failure from a store's; but see `path_alone`."""
  return [{**p, "cluster_path": np.array(paths[p["entity"]], np.int32)} for p in probes]


def path_alone(probes, all_probes, paths) -> float:
  """The recall that knowing a probe's entity path gives without knowing the entity: each probe answered by the
  candidate most of the OTHER entities on its path hold for its attribute (a tie shared: 1/n of a probe for each
  of n tied candidates). An entity's path is fitted on its whole biography, answer included, so the path itself
  says something of the answer; recall on entity paths counts facts the memory holds only above this."""
  values: dict[str, dict[str, str]] = collections.defaultdict(dict)
  for p in all_probes:
    values[p["entity"]][p["attribute"]] = p["answer"]
  on_path = collections.defaultdict(list)
  for name, path in paths.items():
    on_path[path].append(name)
  credit = 0.0
  for p in probes:
    held = collections.Counter(values[other][p["attribute"]] for other in on_path[paths[p["entity"]]]
                               if other != p["entity"])
    counts = [held[c] for c in p["candidates"]]
    best = [c for c, n in zip(p["candidates"], counts) if n == max(counts)]
    credit += (p["answer"] in best) / len(best)
  return credit / len(probes)


def _row_paths(paths, width):
  """Per-row paths [N, levels] (or None) at every one of `width` positions -> [N, width, levels]."""
  return None if paths is None else np.repeat(paths[:, None], width, axis=1)


class ProbeEvaluator:
  """Scores a fixed list of probes with the current params (jitted; shapes fixed per run). Probes carrying a
  "cluster_path" (`with_prompt_paths`) read by it at every position of their rows."""

  def __init__(self, graphdef, probes, tokenizer, batch_rows: int = 64):
    self.probes = probes
    self.num_candidates = len(probes[0]["candidates"])
    self.scorer = Scorer(graphdef, batch_rows)
    paths = np.array([p["cluster_path"] for p in probes], np.int32) if "cluster_path" in probes[0] else None
    rows = make_rows([(tokenizer.encode(p["prompt"]), tokenizer.encode(continuation(p["prompt"], cand)))
                      for p in probes for cand in p["candidates"]], tokenizer.pad_id)
    candidate_paths = None if paths is None else np.repeat(paths, self.num_candidates, axis=0)
    self.rows = rows._replace(paths=_row_paths(candidate_paths, rows.ids.shape[1]))
    self.answer_index = np.array([p["candidates"].index(p["answer"]) for p in probes])
    self.prompts = [tokenizer.encode(p["prompt"]) for p in probes]
    self.answers = [tokenizer.encode(continuation(p["prompt"], p["answer"])) for p in probes]
    self.gen_ids, self.gen_mask = pad_rows([p + [tokenizer.pad_id] * len(a) for p, a in
                                            zip(self.prompts, self.answers)], tokenizer.pad_id)
    self.gen_mask[:] = 0
    for i, p in enumerate(self.prompts):
      self.gen_mask[i, :len(p)] = 1
    self.gen_paths = _row_paths(paths, self.gen_ids.shape[1])
    self.num_new = max(len(a) for a in self.answers)
    self.gen_rows = chunk_rows(len(probes), batch_rows)

    @functools.partial(jax.jit, static_argnums=4)
    def greedy(params, ids, mask, starts, num_new, paths=None):
      model = nnx.merge(graphdef, params)
      rows = jnp.arange(ids.shape[0])

      def body(i, carry):
        ids, mask = carry
        logits, _ = model(ids, mask, cluster_path=paths, train=False)
        pos = starts + i
        nxt = jnp.argmax(logits[rows, pos - 1], axis=-1).astype(ids.dtype)
        return ids.at[rows, pos].set(nxt), mask.at[rows, pos].set(1)
      ids, _ = jax.lax.fori_loop(0, num_new, body, (ids, mask))
      return everywhere(ids)

    self._greedy = greedy

  def per_probe(self, params):
    """(chosen candidate is the answer, greedy continuation equals the answer): bool [num_probes] each."""
    loglik, count = self.scorer(params, self.rows)
    scores = loglik / np.maximum(count, 1).astype(np.float32)
    correct = scores.reshape(len(self.probes), self.num_candidates).argmax(-1) == self.answer_index
    starts = np.array([len(p) for p in self.prompts], np.int32)
    arrays = (self.gen_ids, self.gen_mask, starts) + (() if self.gen_paths is None else (self.gen_paths,))
    out = in_chunks(lambda ids, mask, st, *paths: self._greedy(params, ids, mask, st, self.num_new, *paths),
                    self.gen_rows, *arrays)
    exact = np.array([out[i, s:s + len(a)].tolist() == a for i, (s, a) in enumerate(zip(starts, self.answers))])
    return correct, exact

  def summary(self, correct, exact) -> dict:
    """The training log's recall metrics: overall, and head vs long-tail entities."""
    head = np.array([p["doc_count"] >= HEAD_DOCS for p in self.probes])
    out = {"probe_acc": float(np.mean(correct)), "probe_exact": float(np.mean(exact)),
           "probe_chance": 1.0 / self.num_candidates, "num_probes": len(self.probes)}
    for name, sel in (("head", head), ("tail", ~head)):  # frequent vs long-tail entities
      if sel.any():
        out[f"probe_acc_{name}"] = float(np.mean(correct[sel]))
    return out

  def __call__(self, params) -> dict:
    return self.summary(*self.per_probe(params))


def recall_by_bucket(probes, correct, exact, edges=DOC_BUCKET_EDGES) -> list[dict]:
  """Recall per bucket of the entity's training-document count ([0, edges[0]), [edges[0], edges[1]), ...,
  [edges[-1], inf)); empty buckets are left out. How recall falls along the long tail."""
  docs = np.array([p["doc_count"] for p in probes])
  correct, exact = np.asarray(correct, bool), np.asarray(exact, bool)
  bounds = [0, *edges, None]
  out = []
  for lo, hi in zip(bounds, bounds[1:]):
    sel = (docs >= lo) & (docs < hi if hi is not None else True)
    n = int(sel.sum())
    if not n:
      continue
    acc = float(correct[sel].mean())
    out.append({"docs": f"{lo}-{hi - 1}" if hi is not None else f"{lo}+", "min_docs": lo,
                "max_docs": None if hi is None else hi - 1, "probes": n,
                "entities": len({p["entity"] for p, s in zip(probes, sel) if s}),
                "acc": acc, "acc_stderr": stderr(acc, n), "exact": float(exact[sel].mean())})
  return out
