"""Facts derived from a config: which layers read memory, which bank each reads, how the stack is scanned,
and whether the model is causal. Pure functions of the config (no JAX), shared by validation, the model,
FLOPs counting, conversion and analysis.
"""
from __future__ import annotations

import dataclasses
import math

from moc_jax.config.schema import CAUSAL_ROUTINGS, CHAPTER_KINDS, TREE_ROUTINGS


def routing_is_causal(c) -> bool:
  """Whether each position's output depends only on tokens at or before it (the backbone always is;
  `sequence` routing pools the whole row, the other modes pool the past; product keys look up each token's
  own query)."""
  return not (reads_chapters(c) and c.memory.routing not in CAUSAL_ROUTINGS)


def reads_chapters(c) -> bool:
  """Whether the model has memory whose bank rows are chapters named by chapter ids (memory.kind chapters, or ffn:
  a column a chapter), which memory.routing chooses."""
  return bool(c.memory.enabled and memory_layers(c) and c.memory.kind in CHAPTER_KINDS)


def reads_cluster_paths(c) -> bool:
  """Whether the model reads its chapters by the batch's cluster paths (`memory.routing` cluster or subtree): every
  input it is given then needs each token's path (data/cluster_paths.py)."""
  return reads_chapters(c) and c.memory.routing in TREE_ROUTINGS


def cluster_ranges(num_shared: int, k: int, per_level, generic: bool) -> tuple[list[tuple[int, int]], int | None]:
  """Where cluster routing's chapters lie in the bank: ([start, stop) of the chapters each level's nodes own, level by
  level, node j of level l owning per_level[l] consecutive ones from start + j * per_level[l]], the first of the
  sum(per_level) generic chapters after them (data.cluster.generic), or None)."""
  ranges, start = [], num_shared
  for level, r in enumerate(per_level):
    ranges.append((start, start + r * k ** (level + 1)))
    start = ranges[-1][1]
  return ranges, (start if generic else None)


def subtree_chapters(c) -> int:
  """Chapters owned by a level-0 node of the cluster tree and the nodes below it (`memory.routing=subtree`'s choice):
  Σ_l r_l·k^l."""
  return sum(r * c.data.cluster.k ** level for level, r in enumerate(c.memory.cluster_chapters))


def chapters_read(c) -> int:
  """Chapters each routing decision reads: the shared ones and the top-k routed, or under cluster routing the ones
  owned by the nodes of a path (one memory.cluster_chapters entry per level)."""
  routed = sum(c.memory.cluster_chapters) if c.memory.routing == "cluster" else c.memory.top_k
  return c.memory.num_shared + routed


def routing_statement(c) -> str:
  """One line for the training log: the routing mode and whether the run is causal."""
  if not (c.memory.enabled and memory_layers(c)):
    return "no memory layers: causal"
  if not reads_chapters(c):
    return f"memory.kind={c.memory.kind}: causal (each token looks up its own slots)"
  if routing_is_causal(c):
    return f"memory.routing={c.memory.routing}: causal (no position reads chapters chosen from later tokens)"
  if c.memory.routing == "segment":
    return ("memory.routing=segment: NOT causal (each document's chapters are chosen from all its tokens, "
            "future ones included)")
  if c.memory.routing == "subtree":
    return ("memory.routing=subtree: NOT causal in training (each position's router chooses among the chapters of "
            "its document's subtree, found from its whole text's path); evaluation also reports CE with each token's "
            "path from its prefix")
  if c.memory.routing == "cluster":
    return ("memory.routing=cluster: NOT causal in training (each document reads the chapters of its whole text's "
            "path down the cluster tree); evaluation also reports CE with each token's path from its prefix")
  return ("memory.routing=sequence: NOT causal (each row's chapters are chosen from all its tokens, "
          "future ones included; MoC-PT's paper mode)")


def router_factors(c) -> tuple[int, int]:
  """`memory.router=product`: the a x b grid of the R routable chapters, a = ceil(sqrt(R)), b = ceil(R / a), so
  a + b (the router's outputs) is within one of 2*sqrt(R). Routable chapter r sits at row r // b, column r % b; the
  a*b - R cells past the last chapter name none."""
  routable = c.memory.num_chapters - c.memory.num_shared
  a = math.isqrt(routable - 1) + 1 if routable > 1 else 1
  return a, -(-routable // a)


def memory_layers(c) -> tuple[int, ...]:
  """Sorted indices of the layers that read memory (MoC-PT's placement rules, and `spread`: the middle layer of each
  of placement_k equal spans of depth, so 16 layers and k=4 give the paper's 2, 6, 10, 14, periodic when k divides
  the depth)."""
  m, mem = c.model, c.memory
  L = m.num_layers
  if not mem.enabled or mem.placement == "none":
    return ()
  return tuple({
      "all": lambda: range(L),
      "first_k": lambda: range(min(mem.placement_k, L)),
      "last_k": lambda: range(max(L - mem.placement_k, 0), L),
      "every_n": lambda: range(0, L, mem.placement_n),
      "spread": lambda: ((2 * j + 1) * L // (2 * mem.placement_k) for j in range(min(mem.placement_k, L))),
      "custom": lambda: sorted(i for i in mem.layer_indices if 0 <= i < L),
  }[mem.placement]())


def bank_ids(c) -> tuple[int, ...]:
  """Bank index read by each memory layer, in memory-layer order."""
  n = len(memory_layers(c))
  return tuple({"shared": lambda i: 0, "per_layer": lambda i: i,
                "every_k_layers": lambda i: i // c.memory.sharing_k}[c.memory.sharing](i) for i in range(n))


def base_tables(c, base) -> tuple[tuple[int, int], ...]:
  """Depth up-scaling (`c` from the run of config `base`): the (table of `c`, table of `base`) pairs, sorted, that
  keep every memory layer of the base reading what it read: a memory layer at layer i reads in `c` the table of
  its index in memory_layers(c), and in the base its own. A table of `c` in no pair is new."""
  layers, ids = memory_layers(c), bank_ids(c)
  return tuple(sorted({(ids[layers.index(i)], b) for i, b in zip(memory_layers(base), bank_ids(base))
                       if i in layers}))


@dataclasses.dataclass(frozen=True)
class BankShape:
  """The memory's trainable table as padding, sharding, the bank optimizer and evaluation see it, whatever the
  kind: `tables` tables (memory.sharing) of `rows` rows each, along the logical axis `row_axis`; `always_read`
  rows (the first ones) are part of every read.

  chapters: the chapter bank [tables, C, T, d], a row a chapter, the shared chapters always read (ffn: the columns
  [tables, C, 3, d], a row a column, the shared columns always read). pkm / hml: the
  value table [tables, N, d_v] of N = pkm_sub_keys**2 slots, a row a slot, none always read."""
  tables: int
  rows: int
  row_axis: str
  always_read: int


def bank_shape(c) -> BankShape:
  mem, tables = c.memory, max(bank_ids(c), default=0) + 1
  if mem.kind in CHAPTER_KINDS:
    return BankShape(tables, mem.num_chapters, "chapters", mem.num_shared)
  return BankShape(tables, mem.pkm_sub_keys ** 2, "slots", 0)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How the layer stack is built: `num_groups` copies of a `period`-layer group.

  scanned: groups are stacked and run under `lax.scan` (placement periodic, banks scannable);
  otherwise one group holds every layer, unrolled.
  """
  period: int
  num_groups: int
  memory_offsets: tuple[int, ...]  # positions inside a group that read memory
  scanned: bool

  def slot(self, layer: int) -> tuple[int, int | None]:
    """Where layer `layer` lives: (its block in the group, the group's index on the stacked axis of the scanned
    groups, or None when one unrolled group holds every layer)."""
    group, block = divmod(layer, self.period)
    return block, (group if self.scanned else None)


def layer_plan(c) -> LayerPlan:
  L = c.model.num_layers
  mem_layers = memory_layers(c)
  unrolled = LayerPlan(L, 1, mem_layers, False)
  if not c.model.scan_layers:
    return unrolled
  if c.memory.enabled and c.memory.sharing == "every_k_layers" and c.memory.sharing_k > 1:
    return unrolled
  for period in range(1, L + 1):
    if L % period:
      continue
    offsets = tuple(i for i in mem_layers if i < period)
    expected = {o + g * period for g in range(L // period) for o in offsets}
    if expected == set(mem_layers) and len(offsets) <= 1:
      if L // period == 1:
        return unrolled
      return LayerPlan(period, L // period, offsets, True)
  return unrolled


def decay_start_step(t) -> int:
  """MoC-PT's rule for wsd, cosine and linear alike: decay_start_step wins over decay_start_ratio; without
  either the decay starts at W (no hold); the result is clamped to [W, steps]."""
  if t.decay_start_step is not None:
    start = t.decay_start_step
  elif t.decay_start_ratio is not None:
    start = int(t.steps * t.decay_start_ratio)
  else:
    start = t.warmup_steps
  return max(t.warmup_steps, min(start, t.steps))


def shorter_run(train, steps):
  """config.train of the run of `steps` updates with this run's schedule, the same in all but train.steps: up to its
  decay start it is, update for update, the start of this run (moc_jax/train/cooldown.py)."""
  out = train.copy_and_resolve_references()
  out.steps = steps
  return out


def cooldown_branches(train) -> dict[int, int]:
  """{the update after which each of train.cooldowns branches off: the update its decay ends at}."""
  runs = (shorter_run(train, round(f * train.steps)) for f in train.cooldowns)
  return {decay_start_step(s): s.steps for s in runs}
