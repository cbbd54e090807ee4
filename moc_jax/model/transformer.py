"""The decoder: embedding -> blocks (variant A/B, memory where placed) -> final norm -> tied head.

The memory of a memory layer is `memory.kind`'s: a chapter read (model/memory.py) or a product-key read
(model/pkm.py) between the block's attention and MLP, an hml memory block that runs before the block
(model/hml.py), or FFN columns fetched by the cluster path that widen the block's MLP (model/ffn_memory.py). Its bank (the chapter bank, or the value table) is one parameter of the model, read by the memory
layers as memory.sharing says.

Where the memory placement is periodic (the paper: every 4th layer from 2) the layers are built as
`num_groups` stacked copies of one `period`-layer group and run under `lax.scan`, so compile time
stays flat with depth (on a CPU the scan is unrolled: see `_scan`); otherwise one group holds all
layers, unrolled. Vanilla models are the same code with no memory layer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.config import bank_ids, bank_shape, layer_plan, memory_layers
from moc_jax.model.ffn_memory import ColumnBank, FFNMemory
from moc_jax.model.hml import HMLBlock
from moc_jax.model.layers import MLP, Embed, RMSNorm, SelfAttention, cpu_layouts
from moc_jax.model.memory import BankRows, ChapterBank, MemoryLayer
from moc_jax.model.pkm import PKMLayer
from moc_jax.model.product_keys import SEARCH_RESULT
from moc_jax.model.value_table import ValueTable
from moc_jax.sharding import constrain, padded_chapters

# Both keep the product-key search's slot ids: recomputing an integer result costs the whole search (on a CPU at 4M
# slots, a third of the step) and saves a few bytes per token.
_KEEP_SEARCH = jax.checkpoint_policies.save_only_these_names(SEARCH_RESULT)
_REMAT_POLICIES = {"full": _KEEP_SEARCH, "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KEEP_SEARCH)}


# the memory of a memory layer, by memory.kind: a read inside the block, (hml) a block before it, or (ffn) columns
# of the block's MLP; and the model's bank that the memory layers read
MEMORY_MODULES = {"chapters": MemoryLayer, "pkm": PKMLayer, "hml": HMLBlock, "ffn": FFNMemory}
BANKS = {"chapters": ChapterBank, "pkm": ValueTable, "hml": ValueTable, "ffn": ColumnBank}


class Block(nnx.Module):
  """One decoder layer. Variant A: SA -> memory -> MLP; variant B: SA -> MLP -> memory -> MLP. With
  memory.kind=hml the memory is a block of its own, run before this one (`memory_first`); with memory.kind=ffn it
  reads the MLP's input and adds to its output (`widens_mlp`: variant A only)."""

  def __init__(self, cfg, has_memory, rngs):
    d, eps = cfg.model.d_model, cfg.model.norm_eps
    self.variant = cfg.memory.block_variant if has_memory else "A"
    self.attn_norm, self.attn = RMSNorm(d, eps), SelfAttention(cfg, rngs)
    self.mlp_norm, self.mlp = RMSNorm(d, eps), MLP(cfg, rngs)
    self.memory = MEMORY_MODULES[cfg.memory.kind](cfg, rngs) if has_memory else None
    if self.variant == "B":
      self.post_memory_norm, self.post_memory_mlp = RMSNorm(d, eps), MLP(cfg, rngs)

  @property
  def memory_first(self) -> bool:
    """Whether the memory is a block of its own that runs before this one (hml), not a read inside it."""
    return isinstance(self.memory, HMLBlock)

  @property
  def widens_mlp(self) -> bool:
    """Whether the memory is columns of this block's MLP (ffn), read from the MLP's input."""
    return isinstance(self.memory, FFNMemory)

  def __call__(self, h, positions, mask, valid, segments, bank, paths=None):
    """-> (h, router stats of the block's memory read, or None). `paths`: the cluster paths cluster routing reads."""
    stats = None
    if self.memory_first:
      out, stats = self.memory(h, bank, positions, mask)
      h = h + out
    route_input = h  # routing reads the layer input, before any norm (MoC-PT)

    def read_memory(x):
      nonlocal stats
      out, stats = self.memory(x, route_input, bank, valid, segments, paths)
      return out

    h = self._after_attention(h + self.attn(self.attn_norm(h), positions, mask), read_memory)
    return h, stats

  def decode(self, cache, h, positions, mask, valid, bank, index):
    """Cached decoding (model/decode.py: this block's {k, v[, memory]}, new positions from slot `index`)
    -> (updated cache, h)."""
    new_cache = {}
    if self.memory_first:
      new_cache["memory"], out = self.memory.decode(cache["memory"], h, bank, positions, mask, index)
      h = h + out
    route_input = h
    (k, v), out = self.attn.decode((cache["k"], cache["v"]), self.attn_norm(h), positions, mask, index)
    new_cache.update(k=k, v=v)

    def read_memory(x):
      new_cache["memory"], out = self.memory.decode(cache["memory"], x, route_input, bank, valid, index)
      return out

    return new_cache, self._after_attention(h + out, read_memory)

  def _after_attention(self, h, read_memory):
    """The rest of the block after self-attention: [MLP (B)] -> memory read (`read_memory(h)`) -> MLP."""
    if self.variant == "B":
      h = h + self.mlp(self.mlp_norm(h))
    if self.memory is not None and not (self.memory_first or self.widens_mlp):
      h = h + read_memory(h)
    if self.variant == "B":
      h = h + self.post_memory_mlp(self.post_memory_norm(h))
    elif self.widens_mlp:
      x = self.mlp_norm(h)
      h = h + self.mlp(x) + read_memory(x)
    else:
      h = h + self.mlp(self.mlp_norm(h))
    return constrain(h, "batch", None, None)


class Group(nnx.Module):
  """`period` consecutive blocks; `bank_of` gives the bank read by each memory block (static)."""

  def __init__(self, cfg, period, memory_offsets, rngs):
    self.blocks = nnx.List([Block(cfg, j in memory_offsets, rngs) for j in range(period)])
    self.remat = cfg.model.remat

  def __call__(self, h, positions, mask, valid, segments, banks, bank_of, paths=None):
    """-> (h, router stats of the memory blocks)."""
    stats = []
    for block, bank in zip(self.blocks, self._banks(banks, bank_of)):
      h, s = self._run(block, h, positions, mask, valid, segments, bank, paths)
      if s is not None:
        stats.append(s)
    return h, stats

  def decode(self, cache, h, positions, mask, valid, banks, bank_of, index):
    """Cached decoding, one cache per block -> (updated caches, h). Decoding keeps no activations for a
    backward pass: no remat."""
    new_cache = []
    for block, bank, block_cache in zip(self.blocks, self._banks(banks, bank_of), cache):
      c, h = block.decode(block_cache, h, positions, mask, valid, bank, index)
      new_cache.append(c)
    return new_cache, h

  def _banks(self, banks, bank_of):
    """The bank each block reads (None for blocks without memory), in block order."""
    out, mem_i = [], 0
    for block in self.blocks:
      out.append(None if block.memory is None else banks[bank_of[mem_i]])
      mem_i += block.memory is not None
    return out

  def _run(self, block, h, positions, mask, valid, segments, bank, paths):
    if self.remat == "none":
      return block(h, positions, mask, valid, segments, bank, paths)
    # functional remat: the block is read-only here, and unlike nnx.remat this also works on a module
    # merged outside an enclosing jax loop (e.g. greedy decoding in a fori_loop)
    graphdef, state = nnx.split(block)
    fn = jax.checkpoint(lambda st, *a: nnx.merge(graphdef, st)(*a), policy=_REMAT_POLICIES[self.remat])
    return fn(state, h, positions, mask, valid, segments, bank, paths)


def _first(h_stats):
  """A scanned group's (h, [stats of its one memory block]) -> (h, stats or None)."""
  h, stats = h_stats
  return h, (stats[0] if stats else None)


def _swap(cache_h):
  return cache_h[1], cache_h[0]


def _stack(stats_list):
  return {k: jnp.stack([s[k] for s in stats_list]) for k in stats_list[0]}


class Transformer(nnx.Module):
  """`model(input_ids, attention_mask=None, *, train=False) -> (logits [B,L,V] f32, aux)`.

  aux: `router_loss` (mean over memory layers of the weighted router losses; the training loss adds
  it, evaluation does not) and per-memory-layer `load_balance`, `z_loss`, `mse_aux`, `entropy`,
  `shared_mass`, `routed_entropy` [n_mem] (`bias_spread` too with aux-free balancing), `load` [n_mem, C]
  and `chapters` / `weights` [n_mem, B, shared+top_k]. Product-key kinds (pkm, hml) have no router: `router_loss`
  is 0 and aux holds `slots` [n_mem, B, L, heads, k], the value slots each position read.
  """

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.plan = layer_plan(cfg)
    self.bank_ids = bank_ids(cfg)
    self.embed = Embed(cfg, rngs)
    self.bank = (BANKS[cfg.memory.kind](cfg, max(self.bank_ids) + 1, rngs, padded_chapters(cfg, bank_shape(cfg)))
                 if memory_layers(cfg) else None)
    p = self.plan
    if p.scanned:
      @nnx.split_rngs(splits=p.num_groups)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def make(r):
        return Group(cfg, p.period, p.memory_offsets, r)
      self.layers = make(rngs)
    else:
      self.layers = Group(cfg, p.period, p.memory_offsets, rngs)
    self.final_norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)

  def __call__(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None, cluster_path=None,
               train=False, bank_deltas=None):
    """`segment_ids` (packed rows: 0 = padding, documents 1..n) restrict attention to one document;
    `positions` restart RoPE per document. `sequence` routing pools over the row (MoC-PT); `segment`, `prefix`
    and `chunk` pool within each document (`memory.routing`); `cluster` reads by `cluster_path` [B, L, levels], each
    position's document's path down the cluster tree (the batch's, data/cluster_paths.py). `bank_deltas`
    [n_mem, K, ...] (zeros; a bank row's shape after K): memory layer i reads its bank through `BankRows` with delta
    i, and aux gains `rows` [n_mem, K], the bank rows (chapters, or value slots) whose gradient d loss /
    d bank_deltas holds."""
    h, aux = self.features(input_ids, attention_mask, segment_ids=segment_ids, positions=positions,
                           cluster_path=cluster_path, train=train, bank_deltas=bank_deltas)
    return self.logits(h), aux

  def logits(self, h):
    """[B, L, V] float32 logits of final features (the tied head)."""
    return constrain(self.embed.attend(h), "batch", None, "vocab")

  def features(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None, cluster_path=None,
               train=False, bank_deltas=None):
    """(final-normed features [B, L, d], aux): the model up to the head, for losses that never hold
    all logits at once."""
    del train  # sequence routing and dropout-free blocks behave the same; the loss decides on aux
    b, l = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(l), (b, l))
    mask = jnp.tril(jnp.ones((l, l), bool))[None, None]
    valid = None if attention_mask is None else attention_mask.astype(bool)
    if attention_mask is not None:
      mask = mask & attention_mask.astype(bool)[:, None, None, :]
    if segment_ids is not None:
      mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    h, stats = self._trunk(input_ids, positions, mask, valid, segment_ids, bank_deltas, cluster_path)
    return self.final_norm(h), self._aux(stats)

  def forward_cached(self, cache, input_ids, positions, mask, valid, index):
    """Cached decoding (model/decode.py owns the cache): the next L positions [B, L] at slots
    [index, index+L) -> (updated per-block caches, logits [B, L, V] float32)."""
    h, banks = self._embed(input_ids)
    if self.plan.scanned:
      h, cache = self._scan(h, banks, lambda group, h, bank, c: _swap(
          group.decode(c, h, positions, mask, valid, bank, (0,), index)), cache)
    else:
      cache, h = self.layers.decode(cache, h, positions, mask, valid, banks, self.bank_ids, index)
    return cache, self.logits(self.final_norm(h))

  def _embed(self, input_ids):
    """(embedded tokens, the banks as the memory layers read them: float, or quantized codes)."""
    h = constrain(self.embed(input_ids), "batch", None, None)
    return h, (self.bank.read() if self.bank is not None else None)

  def _trunk(self, input_ids, positions, mask, valid, segments, bank_deltas=None, paths=None):
    """Embedding and layers -> (h, router stats stacked over the memory layers, or None)."""
    h, banks = self._embed(input_ids)
    if self.plan.scanned:
      if bank_deltas is None:
        return self._scan(h, banks, lambda group, h, bank, _: _first(
            group(h, positions, mask, valid, segments, bank, (0,), paths)))
      return self._scan(h, banks, lambda group, h, bank, delta: _first(
          group(h, positions, mask, valid, segments, [BankRows(bank[0], delta)], (0,), paths)), bank_deltas)
    if bank_deltas is None:
      h, stats = self.layers(h, positions, mask, valid, segments, banks, self.bank_ids, paths)
    else:  # memory layer i reads its bank through delta i
      rows = [BankRows(banks[b], delta) for b, delta in zip(self.bank_ids, bank_deltas)]
      h, stats = self.layers(h, positions, mask, valid, segments, rows, tuple(range(len(rows))), paths)
    return h, (_stack(stats) if stats else None)

  def _scan(self, h, banks, run, per_group=None):
    """`lax.scan` of `run(group, h, group_banks, per_group slice) -> (h, out)` over the stacked groups;
    -> (h, outs stacked over groups). With per_layer sharing group g reads bank g."""
    graphdef, state = nnx.split(self.layers)
    per_group_bank = banks is not None and banks.shape[0] > 1

    def body(h, xs):
      group_state, bank, extra = xs
      h, out = run(nnx.merge(graphdef, group_state), h, bank[None] if per_group_bank else banks, extra)
      return constrain(h, "batch", None, None), out

    # A CPU runs the unrolled loop: XLA's CPU while loop slices each group's parameters out of the stack and
    # writes each group's residuals into stacked buffers it first zero-fills (docs/results/2026-11-27-cpu-step-
    # speed.md). Compile time, the reason to scan on an accelerator, does not grow at the depths a CPU trains.
    return jax.lax.scan(body, h, (state, banks if per_group_bank else None, per_group), unroll=cpu_layouts())

  def shift_balance_bias(self, step):
    """Adds `step` [n_mem, C] (routing.balance_bias_step) to the memory layers' aux-free balance biases, in
    memory-layer order (a scanned group's one memory layer holds every group's bias, [num_groups, C])."""
    biases = [b.memory.router.balance_bias for b in self.layers.blocks if b.memory is not None]
    if self.plan.scanned:
      biases[0].set_value(biases[0][...] + step)
    else:
      for bias, s in zip(biases, step):
        bias.set_value(bias[...] + s)

  def _aux(self, stats):
    if stats is None or "load_balance" not in stats:  # no memory, or product keys (no router, no router losses)
      return {"router_loss": jnp.zeros((), jnp.float32), **(stats or {})}
    mem = self.cfg.memory
    per_layer = (mem.load_balance_coef * stats["load_balance"] + mem.z_loss_coef * stats["z_loss"]
                 + mem.mse_aux_coef * stats["mse_aux"])
    return {"router_loss": jnp.mean(per_layer), **stats}
