"""The decoder: embedding -> blocks (variant A/B, memory where placed) -> final norm -> tied head.

Where the memory placement is periodic (the paper: every 4th layer from 2) the layers are built as
`num_groups` stacked copies of one `period`-layer group and run under `lax.scan`, so compile time
stays flat with depth; otherwise one group holds all layers, unrolled. Vanilla models are the same
code with no memory layer.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.config import bank_ids, layer_plan, memory_layers
from moc_jax.model.layers import Embed, RMSNorm, SelfAttention, SwiGLU
from moc_jax.model.memory import ChapterBank, MemoryLayer
from moc_jax.sharding import constrain, padded_chapters

_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Block(nnx.Module):
  """One decoder layer. Variant A: SA -> memory -> MLP; variant B: SA -> MLP -> memory -> MLP."""

  def __init__(self, cfg, has_memory, rngs):
    d, eps = cfg.model.d_model, cfg.model.norm_eps
    self.variant = cfg.memory.block_variant if has_memory else "A"
    self.attn_norm, self.attn = RMSNorm(d, eps), SelfAttention(cfg, rngs)
    self.mlp_norm, self.mlp = RMSNorm(d, eps), SwiGLU(cfg, rngs)
    self.memory = MemoryLayer(cfg, rngs) if has_memory else None
    if self.variant == "B":
      self.post_memory_norm, self.post_memory_mlp = RMSNorm(d, eps), SwiGLU(cfg, rngs)

  def __call__(self, h, positions, mask, valid, bank, cache=None, index=None):
    """-> (h, router stats). With `cache` (cached decoding, model/decode.py: this block's {k, v[, memory]},
    new positions from slot `index`) -> (h, updated cache)."""
    route_input = h  # routing reads the layer input, before any norm (MoC-PT)
    if cache is None:
      h = h + self.attn(self.attn_norm(h), positions, mask)
    else:
      out, (k, v) = self.attn(self.attn_norm(h), positions, mask, (cache["k"], cache["v"]), index)
      h, new_cache = h + out, {"k": k, "v": v}
    stats = None
    if self.variant == "B":
      h = h + self.mlp(self.mlp_norm(h))
    if self.memory is not None:
      if cache is None:
        out, stats = self.memory(h, route_input, bank, valid)
      else:
        out, new_cache["memory"] = self.memory.decode(h, route_input, bank, valid, cache["memory"], index)
      h = h + out
    if self.variant == "B":
      h = h + self.post_memory_mlp(self.post_memory_norm(h))
    else:
      h = h + self.mlp(self.mlp_norm(h))
    return constrain(h, "batch", None, None), (stats if cache is None else new_cache)


class Group(nnx.Module):
  """`period` consecutive blocks; `bank_of` gives the bank read by each memory block (static)."""

  def __init__(self, cfg, period, memory_offsets, rngs):
    self.blocks = nnx.List([Block(cfg, j in memory_offsets, rngs) for j in range(period)])
    self.remat = cfg.model.remat

  def __call__(self, h, positions, mask, valid, banks, bank_of, cache=None, index=None):
    """-> (h, router stats of the memory blocks); with `cache` (one per block) -> (h, updated caches)."""
    outs, mem_i = [], 0
    for i, block in enumerate(self.blocks):
      bank = None
      if block.memory is not None:
        bank, mem_i = banks[bank_of[mem_i]], mem_i + 1
      if cache is not None:  # decoding keeps no activations for a backward pass: no remat
        h, c = block(h, positions, mask, valid, bank, cache[i], index)
        outs.append(c)
        continue
      h, s = self._run(block, h, positions, mask, valid, bank)
      if s is not None:
        outs.append(s)
    return h, outs

  def _run(self, block, h, positions, mask, valid, bank):
    if self.remat == "none":
      return block(h, positions, mask, valid, bank)
    # functional remat: the block is read-only here, and unlike nnx.remat this also works on a module
    # merged outside an enclosing jax loop (e.g. greedy decoding in a fori_loop)
    graphdef, state = nnx.split(block)
    fn = jax.checkpoint(lambda st, *a: nnx.merge(graphdef, st)(*a), policy=_REMAT_POLICIES[self.remat])
    return fn(state, h, positions, mask, valid, bank)


def _stack(stats_list):
  return {k: jnp.stack([s[k] for s in stats_list]) for k in stats_list[0]}


class Transformer(nnx.Module):
  """`model(input_ids, attention_mask=None, *, train=False) -> (logits [B,L,V] f32, aux)`.

  aux: `router_loss` (mean over memory layers of the weighted router losses; the training loss adds
  it, evaluation does not) and per-memory-layer `load_balance`, `z_loss`, `mse_aux`, `entropy`
  [n_mem], `chapters` / `weights` [n_mem, B, shared+top_k].
  """

  def __init__(self, cfg, rngs):
    self.cfg = cfg
    self.plan = layer_plan(cfg)
    self.bank_ids = bank_ids(cfg)
    self.embed = Embed(cfg, rngs)
    self.bank = (ChapterBank(cfg, max(self.bank_ids) + 1, rngs, padded_chapters(cfg))
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

  def __call__(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None, train=False):
    """`segment_ids` (packed rows: 0 = padding, documents 1..n) restrict attention to one document;
    `positions` restart RoPE per document. Routing pools over the row (`memory.routing`), not per document."""
    h, aux = self.features(input_ids, attention_mask, segment_ids=segment_ids, positions=positions, train=train)
    return self.logits(h), aux

  def logits(self, h):
    """[B, L, V] float32 logits of final features (the tied head)."""
    return constrain(self.embed.attend(h), "batch", None, "vocab")

  def features(self, input_ids, attention_mask=None, *, segment_ids=None, positions=None, train=False):
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
    h, stats = self._trunk(input_ids, positions, mask, valid)
    return self.final_norm(h), self._aux(stats)

  def forward_cached(self, input_ids, positions, mask, valid, cache, index):
    """Cached decoding (model/decode.py owns the cache): the next L positions [B, L] at slots
    [index, index+L) -> (logits [B, L, V] float32, updated per-block caches)."""
    h, cache = self._trunk(input_ids, positions, mask, valid, cache, index)
    return self.logits(self.final_norm(h)), cache

  def _trunk(self, input_ids, positions, mask, valid, cache=None, index=None):
    """Embedding and layers -> (h, stacked router stats, or with `cache` the updated caches)."""
    h = constrain(self.embed(input_ids), "batch", None, None)
    banks = self.bank.read() if self.bank is not None else None  # float, or quantized codes
    if self.plan.scanned:
      return self._scan(h, positions, mask, valid, banks, cache, index)
    h, out = self.layers(h, positions, mask, valid, banks, self.bank_ids, cache, index)
    if cache is None:
      out = _stack(out) if out else None
    return h, out

  def _scan(self, h, positions, mask, valid, banks, cache=None, index=None):
    graphdef, state = nnx.split(self.layers)
    per_group_bank = banks is not None and banks.shape[0] > 1  # per_layer sharing: bank g <-> group g

    def body(h, xs):
      group_state, bank, group_cache = xs
      group_banks = bank[None] if per_group_bank else banks
      h, out = nnx.merge(graphdef, group_state)(h, positions, mask, valid, group_banks, (0,), group_cache, index)
      if group_cache is None:
        out = out[0] if out else None
      return constrain(h, "batch", None, None), out

    xs = (state, banks if per_group_bank else None, cache)
    return jax.lax.scan(body, h, xs)

  def _aux(self, stats):
    if stats is None:
      return {"router_loss": jnp.zeros((), jnp.float32)}
    mem = self.cfg.memory
    per_layer = (mem.load_balance_coef * stats["load_balance"] + mem.z_loss_coef * stats["z_loss"]
                 + mem.mse_aux_coef * stats["mse_aux"])
    return {"router_loss": jnp.mean(per_layer), **stats}
