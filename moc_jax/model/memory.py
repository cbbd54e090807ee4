"""The memory read: the chaptered bank, chapter mixing and memory cross-attention (routing decisions:
routing.py). MoC-PT's semantics: docs/mocpt_semantics.md.

`memory.routing` picks what a routing decision sees:
* `sequence` — MoC-PT's paper mode, exact: one decision per row on the mean of every position (pads
  and future tokens included, so NOT causal; a packed row's documents share the decision). Route on the *layer input* -> gather the shared chapters
  then the routed ones -> parameter-free token norm -> scale every token by its chapter weight -> K/V
  projections -> one joint softmax over all selected tokens -> zero-initialised W_o.
* `token` — MoC-PT's token mode: every position routes on its own layer input; shared chapters are
  read by their own attention (weight 1), each routed chapter by its own softmax, summed with weights
  `routed_scaling_factor * w`.
* `segment` — sequence routing per document: each document of a packed row routes on the mean of its
  own non-pad inputs (MoC-PT's one-document rows without their padding); NOT causal.
* `prefix` — causal sequence mode: position t routes on the mean of its document's non-pad inputs at <= t.
* `chunk` — block-causal: positions of chunk j (`routing_chunk` long) route on the mean of their
  document's non-pad inputs before the chunk (none: the router bias alone).
* `cluster` — no router: each position reads the shared chapters and those of the nodes on its document's path
  down the cluster tree (`data.cluster`; the batch's cluster_path), a fixed number, mixed as a router's uniform
  choice would be. NOT causal when the path is the whole document's (training).
* `subtree` — prefix routing whose choice is limited to the chapters of the document's subtree: the router's
  top-k among the chapters owned by its path's level-0 node and the nodes below it (and the shared ones), laid
  out as `cluster`'s. NOT causal when the path is the whole document's (training).
`segment`, `prefix`, `chunk`, `cluster` and `subtree` mix chapters as `sequence` does (weights scale keys and
values, one softmax).
The per-position modes project the (normalised) bank's keys and values once per layer call and read
them through `kernels_pallas.routed_chapter_attention`, never gathering them per (token, chapter).
Cached decoding (`MemoryLayer.decode`) routes by `memory.decode_routing`, which adds the decode-only
`rolling` and `hybrid` strategies of MoC-PT.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.config.schema import CAUSAL_ROUTINGS, TREE_ROUTINGS
from moc_jax.model.chapter_read import read_chapters, routed_attention
from moc_jax.model.layers import NEG_INF, attention, dense, normalize_tokens, param_init, RMSNorm
from moc_jax.model.quantize import dequantize
from moc_jax.model.routing import (Router, cached_decision_input, cached_routing_input, cluster_reads, cluster_tree,
                                   grid_route, grid_router_losses, mix_weights, per_position, pool_share,
                                   resolve_decode_routing, route, router_losses, routing_input, subtree_mask,
                                   with_shared)
from moc_jax.sharding import current


class ChapterBank(nnx.Module):
  """All memory banks as one parameter [num_banks, chapters, chapter_tokens, mem_dim].

  Chapter c of bank b is `memory[b, c]` (MoC-PT rows [c*T, (c+1)*T)); shared chapters come first.
  `padded_chapters` >= num_chapters rounds the chapter axis up to its shard count; the extra chapters
  are zeros that no router logit points at (never read, zero gradient), so every value is the same as
  an unpadded bank drawn from the same seed.
  """

  def __init__(self, cfg, num_banks, rngs, padded_chapters=None):
    mem = cfg.memory
    shape = (num_banks, mem.num_chapters, mem.num_tokens // mem.num_chapters, mem.dim or cfg.model.d_model)
    self.memory = nnx.Param(
        param_init(mem.init_std, "banks", "chapters", "chapter_tokens", "bank_embed")(rngs.params(), shape))
    extra = (padded_chapters or mem.num_chapters) - mem.num_chapters
    if extra:
      self.memory.set_value(jnp.pad(self.memory[...], ((0, 0), (0, extra), (0, 0), (0, 0))))

  def read(self):
    """The banks as the memory layers read them (`quantize.QuantizedChapterBank` returns codes)."""
    return self.memory[...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BankRows:
  """A memory layer's bank in a train step with a sparse bank gradient (`train.bank_optimizer=lazy_adam`).

  `bank` [C, ...] (C rows: the chapters of a chapter bank [C, T, dm], or the slots of a value table [N, d_v]) is
  read but not differentiated; `delta` [K, ...] is zeros and is. The layer gathers the K distinct rows it reads
  (`rows_in_use`) and adds `delta` to them, so d loss / d delta is the bank's gradient on exactly those rows: the
  backward pass never builds a bank-sized gradient, and the bank can grow without the step growing. K is fixed
  before tracing (the row ids the layer can name, plus the rows always read, at most C).
  """
  bank: jax.Array
  delta: jax.Array


def rows_in_use(bank, ids, num_shared):
  """(bank or its rows in use, `ids` indexing them, the rows' ids in the bank [K] or None).

  A plain bank is returned as is. A `BankRows` becomes the sorted distinct rows of `ids` and the `num_shared`
  first rows (the shared chapters: always slots 0..s-1), plus `delta`; slots past the distinct rows name row C
  (none: zero rows, never indexed, their updates dropped)."""
  if not isinstance(bank, BankRows):
    return bank, ids, None
  c, k = bank.bank.shape[0], bank.delta.shape[0]
  flat = jnp.concatenate([jnp.arange(num_shared, dtype=ids.dtype), ids.reshape(-1)])
  used, inverse = jnp.unique(flat, size=k, fill_value=c, return_inverse=True)
  rows = bank.bank.take(used, axis=0, mode="fill", fill_value=0) + bank.delta.astype(bank.bank.dtype)
  return rows, inverse.reshape(-1)[num_shared:].reshape(ids.shape).astype(ids.dtype), used


class MemoryCrossAttention(nnx.Module):
  """Non-causal cross-attention from the residual stream to the selected, weighted memory tokens."""

  def __init__(self, cfg, rngs):
    m, mem = cfg.model, cfg.memory
    self.num_heads, self.num_kv_heads = mem.num_heads, mem.num_kv_heads
    self.head_dim = m.d_model // mem.num_heads
    kv = mem.num_kv_heads * self.head_dim
    dt = jnp.dtype(m.compute_dtype)
    mem_dim = mem.dim or m.d_model
    self.q = dense(m.d_model, m.d_model, m.init_std, ("embed", "heads"), dt, rngs)
    self.k = dense(mem_dim, kv, m.init_std, ("embed", "kv"), dt, rngs)
    self.v = dense(mem_dim, kv, m.init_std, ("embed", "kv"), dt, rngs)
    self.o = dense(m.d_model, m.d_model, 0.0 if mem.wo_init_zero else m.init_std, ("heads", "embed"), dt, rngs)

  def queries(self, x):
    """[B, L, d] (normed) -> [B, L, H, dh]."""
    return self.q(x).reshape(x.shape[:2] + (self.num_heads, self.head_dim))

  def keys_values(self, tokens):
    """Memory tokens [..., N, mem_dim] -> keys, values [..., N, Hkv, dh]."""
    shape = tokens.shape[:-1] + (self.num_kv_heads, self.head_dim)
    return self.k(tokens).reshape(shape), self.v(tokens).reshape(shape)

  def output(self, heads, dtype):
    """Attention result [B, L, H, dh] -> W_o -> [B, L, d]."""
    return self.o(heads.reshape(heads.shape[:2] + (-1,)).astype(dtype))

  def __call__(self, x, tokens):
    """x [B, L, d] (normed), tokens [B, N, mem_dim] already normalised and chapter-weighted."""
    return self.attend(x, *self.keys_values(tokens))

  def attend(self, x, k, v):
    """x [B, L, d] (normed) reads projected memory keys and values [B, N, Hkv, dh]."""
    return self.o(attention(self.queries(x), k, v).astype(x.dtype))


class MemoryLayer(nnx.Module):
  """Router + memory norm + cross-attention for one memory layer.

  `route_input` is the layer input (the residual stream before the block's norms); `x` is the
  residual stream at the point the block reads memory; `valid` [B, L] marks non-pad positions and
  `segments` [B, L] the documents of packed rows (segment, prefix and chunk routing stay inside one); `paths`
  [B, L, levels] each position's document's cluster path (cluster routing, which has no router).
  """

  def __init__(self, cfg, rngs):
    mem = cfg.memory
    self.num_shared, self.top_k = mem.num_shared, mem.top_k
    self.scaling = mem.routed_scaling_factor
    self.routing, self.chunk = mem.routing, mem.routing_chunk
    self.load_balance = mem.load_balance
    self.decode_routing, self.window = resolve_decode_routing(mem), mem.routing_window
    self.attention_impl, self.read_chunk = mem.attention_impl, mem.read_chunk
    # MoC-PT skips the token norm when there are no shared chapters (or no routed ones).
    self.token_norm = mem.token_norm if mem.num_shared > 0 else "none"
    self.token_norm_eps = mem.token_norm_eps
    self.sharded_read = mem.sharded_read
    self.router = Router(cfg, rngs) if mem.routing != "cluster" else None
    # the tree of cluster and subtree routing (branching, chapters per node of each level, chapters, whether generic
    # ones follow the tree's); None without one
    self.cluster = cluster_tree(cfg) if mem.routing in TREE_ROUTINGS else None
    self.norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)
    self.attn = MemoryCrossAttention(cfg, rngs)

  def decide(self, pooled, allowed=None):
    """Router logits of routing inputs `pooled` [..., d] -> (routed ids, routed weights) per decision,
    and the router statistics. `allowed` [..., C] bool: the chapters each decision may choose (subtree routing)."""
    bias = self.router.balance_bias
    bias = None if bias is None else bias[...]
    if self.router.factored:
      grid = self.router.grid(pooled)
      routed_ids, routed_w = grid_route(grid, self.top_k, bias)
      stats = grid_router_losses(grid, routed_ids, self.num_shared, self.load_balance)
    else:
      logits = self.router(pooled)
      if allowed is not None:
        logits = jnp.where(allowed, logits, NEG_INF)
      probs, routed_ids, routed_w = route(logits, self.num_shared, self.top_k, bias)
      stats = router_losses(logits, probs, routed_ids, self.num_shared, self.load_balance)
    if bias is not None:
      stats["bias_spread"] = jnp.max(bias[self.num_shared:]) - jnp.min(bias[self.num_shared:])
    return routed_ids, routed_w, stats

  def select(self, pooled, bank):
    """One decision per row (pooled [B, d]): routes and gathers.
    bank [C, T, dm] -> (tokens [B, (s+k)*T, dm], stats)."""
    routed_ids, routed_w, stats = self.decide(pooled)
    chapters, weights = with_shared(routed_ids, self.num_shared), mix_weights(routed_w, self.num_shared, self.scaling)
    bank, slots, rows = rows_in_use(bank, chapters, self.num_shared)
    if rows is not None:
      stats["rows"] = rows
    sel = read_chapters(bank, slots, self.sharded_read)  # [B, s+k, T, dm]
    sel = normalize_tokens(sel.astype(jnp.float32), self.token_norm, self.token_norm_eps)
    sel = sel * weights[:, :, None, None]
    stats.update(chapters=chapters, weights=weights)
    return sel.reshape(sel.shape[0], -1, sel.shape[-1]), stats

  def __call__(self, h, route_input, bank, valid=None, segments=None, paths=None):
    if self.routing == "cluster":
      return self.read_cluster(h, bank, valid, paths)
    weights = self.router.weigh(route_input, valid)
    subtree = self.routing == "subtree"  # prefix routing, its choice masked by the path
    pooled = routing_input(route_input, valid, "prefix" if subtree else self.routing, self.chunk, segments, weights)
    if self.routing == "sequence":
      tokens, stats = self.select(pooled, bank)
      out = self.attn(self.norm(h), tokens)
    else:
      out, stats = self.read_per_position(h, pooled, bank, self.routing, self.subtree(paths) if subtree else None)
    if weights is not None:  # pool_weights [B, L]: what `moc_jax.eval.pool_focus` reads (unused outputs cost nothing)
      stats.update(pool_share=pool_share(weights), pool_weights=weights)
    return out, stats

  def decode(self, state, h, route_input, bank, valid, index):
    """Cached decoding of L new positions at slots [index, index+L) (the prompt, then one token at a
    time) -> (new state, out). `state` summarises this layer's earlier inputs ({} before the prompt);
    what it holds follows `memory.decode_routing`:
    * token / prefix / chunk: the training modes position by position (`cached_routing_input`), so
      cached decoding gives the logits of a full forward.
    * sequence: one decision on the prompt's masked mean; the selected chapters' keys and values are
      kept and every later token reads them. (MoC-PT's cached decoding instead routes each step on the
      new token alone; a fixed decision keeps what the prompt chose, at no routing cost per token.)
    * rolling: each call routes once on the masked mean of the last `memory.routing_window` layer
      inputs (kept in the state), the prompt included (MoC-PT's).
    * hybrid: the prompt routes on its masked mean and seeds the window; later calls as rolling.
    """
    routing = self.decode_routing
    weights = self.router.weigh(route_input, valid)
    valid = valid if weights is None or routing == "token" else weights  # what each decision pools
    if routing in CAUSAL_ROUTINGS:
      state, pooled = cached_routing_input(state, route_input, valid, routing, self.chunk, index)
      return state, self.read_per_position(h, pooled, bank, routing)[0]
    if routing == "sequence" and state:
      return state, self.attn.attend(self.norm(h), state["k"], state["v"])
    state, pooled = cached_decision_input(state, route_input, valid, routing, self.window)
    tokens, _ = self.select(pooled, bank)
    k, v = self.attn.keys_values(tokens)
    if routing == "sequence":  # decided once: later calls read these chapters' keys and values
      state = {"k": k, "v": v}
    return state, self.attn.attend(self.norm(h), k, v)

  def keys_values_in_use(self, bank, ids):
    """Keys and values [U, T, Hkv, dh] of the chapters `ids` may name, and `ids` re-indexed into them.

    U = every chapter, projected once per call, unless the call names fewer (decision, slot) pairs
    than the bank has chapters (decoding, small batches) and the bank is not sharded: then only the
    distinct chapters named are gathered and projected.
    """
    if ids.size < bank.shape[0] and not current("chapters")[0]:
      used, inverse = jnp.unique(ids.reshape(-1), size=ids.size, fill_value=0, return_inverse=True)
      bank, ids = bank.take(used, axis=0), inverse.reshape(ids.shape).astype(ids.dtype)
    k, v = self.attn.keys_values(normalize_tokens(dequantize(bank), self.token_norm, self.token_norm_eps))
    return k, v, ids

  def subtree(self, paths):
    """subtree routing: the chapters each position may choose, bool [B, L, C] (`routing.subtree_mask`)."""
    if paths is None:
      raise ValueError("memory.routing=subtree chooses among the chapters of each document's subtree: pass "
                       "cluster_path [B, L, levels] (the batch's, with data.cluster.k > 0)")
    k, per_level, num_chapters, _ = self.cluster
    return subtree_mask(paths, self.num_shared, k, per_level, num_chapters)

  def read_per_position(self, h, pooled, bank, routing, allowed=None):
    """segment / token / prefix / chunk / subtree routing: each position reads its own chapters (decided on
    `pooled`, among `allowed`)."""
    routed_ids, routed_w, stats = self.decide(pooled, allowed)
    if routing == "token":
      return self.read_positions(h, routed_ids, routed_w, bank, routing, stats)
    chapters, weights = with_shared(routed_ids, self.num_shared), mix_weights(routed_w, self.num_shared, self.scaling)
    return self.read_positions(h, chapters, weights, bank, routing, stats)

  def read_cluster(self, h, bank, valid, paths):
    """cluster routing: every position reads the chapters of its document's path (`cluster_chapters`), weighted as
    a router that chose them uniformly would weigh them (`mix_weights`). Stats: the chapters and weights, and `load`,
    the routed reads per chapter over the real positions (the router health a router's choice would report)."""
    if paths is None:
      raise ValueError("memory.routing=cluster reads the chapters of each document's cluster path: pass cluster_path "
                       "[B, L, levels] (the batch's, with data.cluster.k > 0)")
    chapters, load = cluster_reads(paths, self.num_shared, self.cluster, valid)
    routed = chapters.shape[-1] - self.num_shared
    weights = mix_weights(jnp.full(chapters.shape[:-1] + (routed,), 1.0 / routed), self.num_shared, self.scaling)
    return self.read_positions(h, chapters, weights, bank, "cluster", {"load": load})

  def read_positions(self, h, chapters, weights, bank, routing, stats):
    """Each position (or chunk, `per_position`) reads `chapters` [B, D, S] weighted by `weights`: in one softmax
    whose keys and values the weights scale, or, under token routing, the routed chapters by one softmax each
    (weights `routed_scaling_factor * w`) and the shared ones by their own attention (weight 1)."""
    q = self.attn.queries(self.norm(h))
    token = routing == "token"
    bank, slots, rows = rows_in_use(bank, chapters, self.num_shared)
    if rows is not None:
      stats["rows"] = rows

    def read(ids, logit_scale, value_scale, combine):
      k, v, ids = self.keys_values_in_use(bank, ids)
      slots = (per_position(x, routing, self.chunk, h.shape[1]) for x in (ids, logit_scale, value_scale))
      return routed_attention(q, k, v, *slots, combine=combine, implementation=self.attention_impl,
                              chunk=self.read_chunk)

    if token:
      out = read(slots, jnp.ones_like(weights), self.scaling * weights, "moe")
      if self.num_shared:
        shared = normalize_tokens(dequantize(bank[:self.num_shared]), self.token_norm, self.token_norm_eps)
        ks, vs = self.attn.keys_values(jnp.broadcast_to(shared.reshape(1, -1, shared.shape[-1]),
                                                        (q.shape[0], shared.shape[0] * shared.shape[1], shared.shape[-1])))
        out = out + attention(q, ks, vs).reshape(out.shape)
    else:
      out = read(slots, weights, weights, "joint")
    stats.update(chapters=chapters, weights=weights)
    return self.attn.output(out, h.dtype), stats
