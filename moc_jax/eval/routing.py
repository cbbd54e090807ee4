"""Where the routers send an evaluation set, and what the chapters they pick are worth.

Usage: per memory layer, how often each chapter is *routed to* over the routing decisions of the
eval split — one decision per row (`sequence` routing), per real position (`segment`, `token`, `prefix`; a
document's `segment` decision counts once per token) or per chunk holding a real position (`chunk`; per
position on packed rows); decisions that see only padding are not counted. Shared chapters are
read by every decision and are left out: counts, entropy and coverage are over the routable chapters.

Stability: for each fact-recall probe the routed chapter set of its prompt is compared, by Jaccard overlap
|A ∩ B| / |A ∪ B|, with the set for the same fact in another training template of its attribute
(`paraphrase`) and with the set for the same template about another entity (`other_entity`, the
baseline). The decision compared is the one that predicts the answer's first token: the row's
(`sequence`), the last prompt position's (`token`, `prefix`) or that position's chunk's (`chunk`).
Routing keyed on the fact shows paraphrase overlap above the baseline.

Ablation: chosen chapters of the bank are set to zero and the split's CE measured again. A router reads its
layer's input, not the bank: the first memory layer picks the same chapters, later ones may pick others once
an earlier read has changed. The change is what the chapters' contents contribute, through the reads and
through that rerouting (a chapter no decision picks changes nothing, exactly).

The product-key kinds (memory.kind pkm, hml) are analysed the same way with value slots for chapters: usage
counts every head's k slots at every real position, `routed` zeroes the whole table (no slot is always read),
and stability is not measured.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moc_jax import sharding
from moc_jax.config import bank_ids, bank_shape, cluster_ranges, memory_layers, reads_cluster_paths
from moc_jax.errors import ConfigError
from moc_jax.eval.scoring import chunk_rows, everywhere, in_chunks, pad_rows
from moc_jax.router_health import load_stats


def decision_mask(attention_mask, routing: str, chunk: int):
  """Which routing decisions see at least one real token: [B] (sequence), [B, L] (segment, token, prefix) or
  [B, ceil(L / chunk)] (chunk)."""
  valid = np.asarray(attention_mask).astype(bool)
  if routing == "sequence":
    return valid.any(axis=1)
  if routing == "chunk":
    b, length = valid.shape
    n = -(-length // chunk)
    return np.pad(valid, ((0, 0), (0, n * chunk - length))).reshape(b, n, chunk).any(axis=-1)
  return valid


def routed_ids(chapters, routing: str, num_shared: int):
  """The routed part of aux `chapters` [n_mem, B, ..., slots] (token routing lists routed chapters only;
  the other modes list the shared chapters first)."""
  return chapters if routing == "token" else chapters[..., num_shared:]


class Usage:
  """Routed selections per (memory layer, bank row) over the decisions of the batches given to `add`: chapters,
  or the value slots of product-key lookups (`unit`), one decision per real position."""

  def __init__(self, config):
    mem, bank = config.memory, bank_shape(config)
    self.layers, self.banks = memory_layers(config), bank_ids(config)
    self.unit = {"chapters": "chapters", "ffn": "columns"}.get(mem.kind, "slots")
    self.routing, self.chunk, self.num_shared = mem.routing, mem.routing_chunk, bank.always_read
    self.counts = np.zeros((len(self.layers), bank.rows), np.int64)
    self.decisions = 0
    self.router_sums, self.batches = {}, 0  # per-layer router statistics summed over batches

  def add(self, routing, attention_mask) -> None:
    """routing: one batch's aux `chapters` and per-layer router statistics (eval.ce.ROUTING_STATS), or its aux
    `slots`; attention_mask: its [B, L] mask."""
    if "slots" in routing:
      valid, ids = np.asarray(attention_mask).astype(bool), np.asarray(routing["slots"])
    else:
      chapters = np.asarray(routing["chapters"])
      per_position = chapters.ndim == 4 and chapters.shape[2] == np.shape(attention_mask)[1]  # packed chunk rows
      valid = decision_mask(attention_mask, "prefix" if per_position else self.routing, self.chunk)
      ids = routed_ids(chapters, self.routing, self.num_shared)
    for i in range(len(self.layers)):
      self.counts[i] += np.bincount(ids[i][valid].reshape(-1), minlength=self.counts.shape[1])
    self.decisions += int(valid.sum())
    for k, v in routing.items():
      if k not in ("chapters", "slots"):
        self.router_sums[k] = self.router_sums.get(k, 0.0) + np.asarray(v, np.float64)
    self.batches += 1

  def stats(self) -> list[dict]:
    """Per memory layer: selections, coverage, max/mean load, usage entropy (nats), the most used rows (chapters
    or slots: `unit`), and the router's mean shared-chapter mass and routable-softmax entropy over the batches."""
    out, unit = [], self.unit
    for i, (layer, bank) in enumerate(zip(self.layers, self.banks)):
      routable = self.counts[i, self.num_shared:]
      total = int(routable.sum())
      p = routable[routable > 0] / max(total, 1)
      entropy = float(-(p * np.log(p)).sum())
      top = np.argsort(-routable, kind="stable")[:10]
      out.append({"layer": layer, "bank": bank, "decisions": self.decisions, "routed_selections": total,
                  f"{unit}_selected": int((routable > 0).sum()),
                  f"{unit}_selected_frac": float((routable > 0).mean()),
                  "max_load": load_stats(self.counts[i], self.num_shared)["max_load"],
                  "usage_entropy": entropy, "usage_entropy_max": math.log(len(routable)),
                  f"effective_{unit}": math.exp(entropy),
                  **{k: float(v[i] / self.batches) for k, v in self.router_sums.items()},
                  f"top_{unit}": [[int(c + self.num_shared), int(routable[c])] for c in top if routable[c]],
                  "counts": self.counts[i].tolist()})
    return out


def balance_bias_spread(params, num_shared):
  """Per memory layer, max - min of the aux-free balance bias over the routable chapters (None without one)."""
  leaves = [np.asarray(v[...]) for path, v in nnx.to_flat_state(params) if "balance_bias" in map(str, path)]
  if not leaves:
    return None
  bias = np.concatenate([x.reshape(-1, x.shape[-1]) for x in leaves])[:, num_shared:]  # memory-layer order
  return (bias.max(-1) - bias.min(-1)).tolist()


# --- stability ------------------------------------------------------------------------------------

def _cloze(template: str, name: str) -> str:
  """A training template's prompt for `name` (the text before its value), as moc_facts makes probes."""
  return template[:template.index("{value}")].rstrip().format(name=name)


def stability_prompts(probes):
  """(prompt, paraphrase, other-entity prompt) per probe, or None for the baseline when the probes
  name a single entity."""
  from moc_jax.data.facts import ATTRIBUTES
  entities = sorted({p["entity"] for p in probes})
  triples = []
  for p in probes:
    templates = ATTRIBUTES[p["attribute"]][1]
    j = next((j for j, t in enumerate(templates) if _cloze(t, p["entity"]) == p["prompt"]), 0)
    other = entities[(entities.index(p["entity"]) + 1) % len(entities)]
    triples.append((p["prompt"], _cloze(templates[(j + 1) % len(templates)], p["entity"]),
                    _cloze(templates[j], other) if other != p["entity"] else None))
  return triples


def answer_decision(chapters, attention_mask, routing: str, chunk: int, num_shared: int):
  """Routed chapters [n_mem, B, k] of the decision that predicts the token after each row's last real one."""
  ids = routed_ids(np.asarray(chapters), routing, num_shared)
  if routing == "sequence":
    return ids
  last = np.asarray(attention_mask).sum(axis=1) - 1
  return ids[:, np.arange(ids.shape[1]), last // chunk if routing == "chunk" else last]


def jaccard(a, b):
  """Row-wise |A ∩ B| / |A ∪ B| of chapter-id sets a, b [N, k]."""
  return np.array([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a.tolist(), b.tolist())])


class Router:
  """Routing decisions of token rows: (ids, mask) [N, W] -> chapters [n_mem, N, ...] (jitted, chunked)."""

  def __init__(self, graphdef, batch_rows: int = 64):
    self.batch_rows = batch_rows

    @jax.jit
    def route(params, ids, mask):
      _, aux = nnx.merge(graphdef, params).features(ids, mask)
      return everywhere(jnp.moveaxis(aux["chapters"], 0, 1))  # rows first, for chunking

    self._route = route

  def __call__(self, params, ids, mask):
    out = in_chunks(lambda i, m: self._route(params, i, m), chunk_rows(len(ids), self.batch_rows), ids, mask)
    return np.moveaxis(out, 0, 1)


def stability(router, params, probes, tokenizer, config) -> list[dict]:
  """Mean Jaccard overlap per memory layer: prompt vs paraphrase, and prompt vs other entity."""
  triples = stability_prompts(probes)
  with_other = [t for t in triples if t[2] is not None]
  texts = [t[0] for t in triples] + [t[1] for t in triples] + [t[0] for t in with_other] + [t[2] for t in with_other]
  ids, mask = pad_rows([tokenizer.encode(t) for t in texts], tokenizer.pad_id)  # one width: fair to sequence routing
  mem = config.memory
  sets = answer_decision(router(params, ids, mask), mask, mem.routing, mem.routing_chunk, mem.num_shared)
  n, m = len(triples), len(with_other)
  out = []
  for i, layer in enumerate(memory_layers(config)):
    s = sets[i]
    row = {"layer": layer, "pairs": n, "paraphrase_jaccard": float(jaccard(s[:n], s[n:2 * n]).mean())}
    if m:
      row["other_entity_jaccard"] = float(jaccard(s[2 * n:2 * n + m], s[2 * n + m:]).mean())
    out.append(row)
  return out


# --- ablation -------------------------------------------------------------------------------------

def parse_ablation(spec: str, config):
  """`--ablate_chapters`: ("top", N) for `top:N`, ("routed", None) for `routed` (every routable chapter: the
  bank's content without the shared chapters, to ask how much of the model's knowledge lives in it; a product-key
  table's every slot), ("ids", [chapter or slot ids]), or under cluster routing ("ids", the chapters the tree's
  levels own) for `level:L[,L...]` (0: the root's children, data.cluster.levels - 1: the leaves); ConfigError naming
  the fix."""
  if not memory_layers(config):
    raise ConfigError("--ablate_chapters: this model has no memory bank")
  num_chapters = bank_shape(config).rows
  unit = {"chapters": "chapter", "ffn": "column"}.get(config.memory.kind, "slot")
  fix = f"use comma-separated {unit} ids in [0, {num_chapters}), top:N or routed"
  spec = spec.strip()
  if spec == "routed":
    return "routed", None
  if spec.startswith("level:"):
    return "ids", _level_chapters(spec, config)
  if spec.startswith("top:"):
    if not spec[4:].isdigit() or int(spec[4:]) < 1:
      raise ConfigError(f"--ablate_chapters={spec!r}: N must be a positive integer — {fix}")
    return "top", int(spec[4:])
  try:
    ids = [int(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    ids = []
  if not ids or any(not 0 <= c < num_chapters for c in ids):
    raise ConfigError(f"--ablate_chapters={spec!r}: not a list of {unit} ids in range — {fix}")
  return "ids", ids


def _level_chapters(spec, config) -> list[int]:
  """The chapters owned by the nodes of the levels `level:L[,L...]` names (config.cluster_ranges)."""
  if not reads_cluster_paths(config):
    raise ConfigError(f"--ablate_chapters={spec!r}: levels are a cluster tree's; this model has memory.routing="
                      f"{config.memory.routing!r} — use chapter ids, top:N or routed")
  levels = config.data.cluster.levels
  parts = spec[len("level:"):].split(",")
  if not all(p.strip().isdigit() and int(p) < levels for p in parts):
    raise ConfigError(f"--ablate_chapters={spec!r}: not a list of levels in [0, {levels}) (data.cluster.levels) — "
                      f"e.g. level:{levels - 1} for the leaves")
  ranges, _ = cluster_ranges(config.memory.num_shared, config.data.cluster.k, config.memory.cluster_chapters, False)
  return sorted({c for p in parts for c in range(*ranges[int(p)])})


def ablation_mask(parsed, usage: Usage):
  """Chapters to zero [num_banks, num_chapters]: the ids in every bank, every routable chapter of every bank,
  or per bank the N routable chapters its memory layers selected most (only chapters selected at least once)."""
  kind, value = parsed
  mask = np.zeros((max(usage.banks) + 1, usage.counts.shape[1]), bool)
  if kind == "ids":
    mask[:, value] = True
    return mask
  if kind == "routed":
    mask[:, usage.num_shared:] = True
    return mask
  for b in range(mask.shape[0]):
    counts = usage.counts[[i for i, bank in enumerate(usage.banks) if bank == b]].sum(axis=0)
    counts[:usage.num_shared] = 0
    top = np.argsort(-counts, kind="stable")[:value]
    mask[b, top[counts[top] > 0]] = True
  return mask


def zero_chapters(params, mask):
  """params with bank rows (chapters, or value slots) `mask` [banks, rows] set to zero, in the device layout
  (padding and sharding kept)."""
  def zero(x):
    full = np.zeros(x.shape[:2], bool)
    full[:, :mask.shape[1]] = mask
    return jax.jit(lambda x, m: jnp.where(m.reshape(m.shape + (1,) * (x.ndim - 2)), jnp.zeros_like(x), x),
                   out_shardings=x.sharding)(x, full)
  return sharding.map_bank(lambda x, bank: zero(x) if bank else x, params)


# --- plots ------------------------------------------------------------------------------------------

def plot(usage: Usage, heatmap_path: str, histogram_path: str) -> None:
  """A heatmap (memory layers x routable chapters sorted by total usage, colour = share of the layer's
  routed selections) and a histogram of selections per chapter, one line per layer."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  s = usage.num_shared
  routable = usage.counts[:, s:]
  order = np.argsort(-routable.sum(axis=0), kind="stable")
  share = routable[:, order] / np.maximum(routable.sum(axis=1, keepdims=True), 1)
  fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(usage.layers)))
  im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
  ax.set_yticks(range(len(usage.layers)), [f"layer {layer}" for layer in usage.layers])
  ax.set_xlabel(f"routable {usage.unit} ranked by total usage (of {routable.shape[1]}); {usage.decisions} decisions")
  fig.colorbar(im, ax=ax, label="share of selections")
  fig.tight_layout()
  fig.savefig(heatmap_path, dpi=100)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(6, 4))
  bins = np.histogram_bin_edges(routable, bins=min(40, int(routable.max()) + 1))
  for layer, row in zip(usage.layers, routable):
    ax.hist(row, bins=bins, histtype="step", label=f"layer {layer}: {int((row == 0).sum())} never selected")
  ax.set_xlabel(f"selections of a {usage.unit[:-1]}"), ax.set_ylabel(usage.unit), ax.legend(), ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(histogram_path, dpi=100)
  plt.close(fig)
