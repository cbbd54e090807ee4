"""The memory read: chaptered bank, router (top-k + aux losses), chapter mixing and memory
cross-attention (reference_spec.md §1.3–§1.7, §2.2, §3).

`memory.routing` picks what a routing decision sees:
* `sequence` — MoC-PT's paper mode, exact: one decision per row on the mean of every position (pads
  and future tokens included, so NOT causal). Route on the *layer input* -> gather the shared chapters
  then the routed ones -> parameter-free token norm -> scale every token by its chapter weight -> K/V
  projections -> one joint softmax over all selected tokens -> zero-initialised W_o.
* `token` — MoC-PT's token mode: every position routes on its own layer input; shared chapters are
  read by their own attention (weight 1), each routed chapter by its own softmax, summed with weights
  `routed_scaling_factor * w`.
* `prefix` — causal sequence mode: position t routes on the mean of the non-pad inputs at <= t.
* `chunk` — block-causal: positions of chunk j (`routing_chunk` long) route on the mean of the non-pad
  inputs before the chunk (chunk 0 on the router bias alone).
`prefix` and `chunk` mix chapters as `sequence` does (weights scale keys and values, one softmax).
The per-position modes project the (normalised) bank's keys and values once per layer call and read
them through `kernels_pallas.routed_chapter_attention`, never gathering them per (token, chapter).
Cached decoding (`MemoryLayer.decode`) routes by `memory.decode_routing`, which adds the decode-only
`rolling` and `hybrid` strategies of MoC-PT.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.model.chapter_read import read_chapters, routed_attention
from moc_jax.model.layers import attention, dense, param_init, rms_normalize, RMSNorm
from moc_jax.quantize import dequantize
from moc_jax.sharding import current

CAUSAL_ROUTINGS = ("token", "prefix", "chunk")


def resolve_decode_routing(mem):
  """`memory.decode_routing` with `auto` resolved: the training routing when it is causal (cached
  decoding then equals a full forward), `sequence` (routed once on the prompt) otherwise."""
  if mem.decode_routing != "auto":
    return mem.decode_routing
  return mem.routing if mem.routing in CAUSAL_ROUTINGS else "sequence"


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


def route(logits, num_shared, top_k):
  """MoC-PT routing on router logits [..., C] (float32), one decision per leading index.

  Returns (probs [...,C] over all chapters, routed ids [...,k] in chapter space sorted by descending
  probability, routed weights [...,k] = softmax restricted to the selected set).
  MoC-PT renormalises probabilities twice (drop shared, keep top-k); that equals top-k on the routed
  logits and a softmax over the selected ones, which we compute directly: it stays finite when the
  shared chapter takes all the probability mass (the load-balance loss's degenerate minimum), where
  the renormalisation divides 0 by 0.
  """
  logits = logits.astype(jnp.float32)
  top_logits, top_idx = jax.lax.top_k(logits[..., num_shared:], top_k)
  return jax.nn.softmax(logits, axis=-1), top_idx + num_shared, jax.nn.softmax(top_logits, axis=-1)


def mix_weights(routed_weights, num_shared, scaling):
  """Chapter weights for [shared..., routed...]: raw [1,...,f*w...] divided by their sum (§1.5)."""
  ones = jnp.ones(routed_weights.shape[:-1] + (num_shared,), routed_weights.dtype)
  raw = jnp.concatenate([ones, scaling * routed_weights], axis=-1)
  return raw / jnp.sum(raw, axis=-1, keepdims=True)


def with_shared(routed_ids, num_shared):
  """Chapter list [shared 0..s-1, routed...] for every decision."""
  shared = jnp.arange(num_shared, dtype=routed_ids.dtype)
  return jnp.concatenate([jnp.broadcast_to(shared, routed_ids.shape[:-1] + (num_shared,)), routed_ids], -1)


def router_losses(logits, probs, routed_ids):
  """Per-layer router statistics (§3): Switch load-balance (quirks kept), z-loss, MSE aux, entropy.

  Every routing decision (a row, a position or a chunk) is one sample. f counts routed selections
  only, so shared chapters have f = 0 while P still includes them.
  """
  c = probs.shape[-1]
  logits, probs, routed_ids = (x.reshape(-1, x.shape[-1]) for x in (logits, probs, routed_ids))
  # selections per chapter / decisions, counted without a [decisions, k, C] one-hot
  f = jnp.zeros((c,), jnp.float32).at[routed_ids.reshape(-1)].add(1.0) / routed_ids.shape[0]
  p_mean = jnp.mean(probs, axis=0)
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return {
      "load_balance": c * jnp.sum(f * p_mean),
      "z_loss": jnp.mean(jnp.square(lse)),
      "mse_aux": jnp.mean(jnp.square(jnp.mean(jnp.square(probs), axis=0) - 1.0 / c)),
      "entropy": jnp.mean(-jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-12)), axis=-1)),
  }


def normalize_tokens(x, kind, eps):
  """Parameter-free per-token normalisation of the selected memory tokens (§1.6 step 2)."""
  if kind == "rms":
    return rms_normalize(x, eps)
  if kind == "layernorm":
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True) + eps)
  return x


def routing_input(h, valid, routing, chunk):
  """What each routing decision sees, from the layer input h [B, L, d] and non-pad mask valid [B, L]:
  sequence [B, d] (plain mean, pads included, as MoC-PT), token [B, L, d] (h itself), prefix [B, L, d]
  (masked mean of positions <= t), chunk [B, ceil(L/chunk), d] (masked mean before the chunk; zeros
  for chunk 0, so the router sees its bias alone)."""
  h = h.astype(jnp.float32)
  if routing == "sequence":
    return jnp.mean(h, axis=1)
  if routing == "token":
    return h
  w = jnp.ones(h.shape[:2], jnp.float32) if valid is None else valid.astype(jnp.float32)
  total, count = jnp.cumsum(h * w[..., None], axis=1), jnp.cumsum(w, axis=1)[..., None]
  if routing == "chunk":  # sums up to the position before each chunk start
    before = jnp.arange(0, h.shape[1], chunk) - 1
    total = jnp.where(before[None, :, None] >= 0, jnp.take(total, jnp.maximum(before, 0), axis=1), 0.0)
    count = jnp.where(before[None, :, None] >= 0, jnp.take(count, jnp.maximum(before, 0), axis=1), 0.0)
  return total / jnp.maximum(count, 1.0)


def per_position(x, routing, chunk, length):
  """Decisions [B, D, ...] -> [B, length, ...]: chunk decisions repeat over their chunk's positions
  (decisions already made per position, as in cached decoding, pass through)."""
  if routing == "chunk" and x.shape[1] != length:
    return jnp.repeat(x, chunk, axis=1)[:, :length]
  return x


def masked_mean(x, valid):
  """Mean over axis 1 of x [B, L, d] at the positions valid [B, L] marks (zeros where none)."""
  w = valid.astype(jnp.float32)[..., None]
  return jnp.sum(x.astype(jnp.float32) * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)


def cached_routing_input(h, valid, state, routing, chunk, index):
  """`routing_input` of the positions at slots index, index+1, ... of a row whose earlier layer inputs
  `state` summarises ({} before the first call): per-position routing inputs [B, L, d] and the new
  state. prefix keeps the running masked sum and count of the inputs; chunk also keeps them as of the
  current chunk's start; token keeps nothing."""
  h = h.astype(jnp.float32)
  if routing == "token":
    return h, {}
  b, l, d = h.shape
  w = valid.astype(jnp.float32)
  total0, count0 = state.get("total", jnp.zeros((b, d))), state.get("count", jnp.zeros((b,)))
  # running sums over the slots before index + j, j = 0..L
  total = jnp.concatenate([total0[:, None], total0[:, None] + jnp.cumsum(h * w[..., None], axis=1)], axis=1)
  count = jnp.concatenate([count0[:, None], count0[:, None] + jnp.cumsum(w, axis=1)], axis=1)
  new = {"total": total[:, -1], "count": count[:, -1]}
  if routing == "prefix":
    return total[:, 1:] / jnp.maximum(count[:, 1:, None], 1.0), new
  # chunk: the sums before each slot's chunk start; a chunk that began before this call uses the saved ones
  start = (index + jnp.arange(l + 1)) // chunk * chunk - index
  inside = start >= 0
  total = jnp.where(inside[None, :, None], jnp.take(total, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_total", jnp.zeros((b, d)))[:, None])
  count = jnp.where(inside[None, :], jnp.take(count, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_count", jnp.zeros((b,)))[:, None])
  new.update(chunk_total=total[:, -1], chunk_count=count[:, -1])
  return total[:, :-1] / jnp.maximum(count[:, :-1, None], 1.0), new


class Router(nnx.Module):
  """One linear router per memory layer over all C chapters (bias included, as MoC-PT)."""

  def __init__(self, cfg, rngs):
    self.proj = dense(cfg.model.d_model, cfg.memory.num_chapters, cfg.model.init_std, ("embed", "chapter_logits"),
                      jnp.dtype(cfg.model.compute_dtype), rngs, bias=True)

  def __call__(self, pooled):
    """Logits [..., C] (float32) of routing inputs [..., d] (see `routing_input`)."""
    return self.proj(pooled).astype(jnp.float32)


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
  residual stream at the point the block reads memory; `valid` [B, L] marks non-pad positions.
  """

  def __init__(self, cfg, rngs):
    mem = cfg.memory
    self.num_shared, self.top_k = mem.num_shared, mem.top_k
    self.scaling = mem.routed_scaling_factor
    self.routing, self.chunk = mem.routing, mem.routing_chunk
    self.decode_routing, self.window = resolve_decode_routing(mem), mem.routing_window
    self.attention_impl = mem.attention_impl
    # MoC-PT skips the token norm when there are no shared chapters (or no routed ones).
    self.token_norm = mem.token_norm if mem.num_shared > 0 else "none"
    self.token_norm_eps = mem.token_norm_eps
    self.sharded_read = mem.sharded_read
    self.router = Router(cfg, rngs)
    self.norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)
    self.attn = MemoryCrossAttention(cfg, rngs)

  def decide(self, pooled):
    """Router logits of routing inputs `pooled` [..., d] -> (routed ids, routed weights) per decision,
    and the router statistics."""
    logits = self.router(pooled)
    probs, routed_ids, routed_w = route(logits, self.num_shared, self.top_k)
    return routed_ids, routed_w, router_losses(logits, probs, routed_ids)

  def select(self, pooled, bank):
    """One decision per row (pooled [B, d]): routes and gathers.
    bank [C, T, dm] -> (tokens [B, (s+k)*T, dm], stats)."""
    routed_ids, routed_w, stats = self.decide(pooled)
    chapters, weights = with_shared(routed_ids, self.num_shared), mix_weights(routed_w, self.num_shared, self.scaling)
    sel = read_chapters(bank, chapters, self.sharded_read)  # [B, s+k, T, dm]
    sel = normalize_tokens(sel.astype(jnp.float32), self.token_norm, self.token_norm_eps)
    sel = sel * weights[:, :, None, None]
    stats.update(chapters=chapters, weights=weights)
    return sel.reshape(sel.shape[0], -1, sel.shape[-1]), stats

  def __call__(self, h, route_input, bank, valid=None):
    pooled = routing_input(route_input, valid, self.routing, self.chunk)
    if self.routing == "sequence":
      tokens, stats = self.select(pooled, bank)
      return self.attn(self.norm(h), tokens), stats
    return self.read_per_position(h, pooled, bank, self.routing)

  def decode(self, h, route_input, bank, valid, state, index):
    """Cached decoding of L new positions at slots [index, index+L) (the prompt, then one token at a
    time) -> (out, new state). `state` summarises this layer's earlier inputs ({} before the prompt);
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
    if routing in CAUSAL_ROUTINGS:
      pooled, state = cached_routing_input(route_input, valid, state, routing, self.chunk, index)
      return self.read_per_position(h, pooled, bank, routing)[0], state
    if routing == "sequence" and state:
      return self.attn.attend(self.norm(h), state["k"], state["v"]), state
    if routing == "sequence":
      pooled = masked_mean(route_input, valid)
    else:
      b, _, d = route_input.shape
      window = jnp.concatenate([state.get("window", jnp.zeros((b, self.window, d))),
                                route_input.astype(jnp.float32)], axis=1)[:, -self.window:]
      seen = jnp.concatenate([state.get("seen", jnp.zeros((b, self.window), bool)), valid], axis=1)[:, -self.window:]
      first_hybrid = routing == "hybrid" and not state
      pooled = masked_mean(route_input, valid) if first_hybrid else masked_mean(window, seen)
    tokens, _ = self.select(pooled, bank)
    k, v = self.attn.keys_values(tokens)
    new = {"k": k, "v": v} if routing == "sequence" else {"window": window, "seen": seen}
    return self.attn.attend(self.norm(h), k, v), new

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

  def read_per_position(self, h, pooled, bank, routing):
    """token / prefix / chunk routing: each position reads its own chapters (decided on `pooled`)."""
    routed_ids, routed_w, stats = self.decide(pooled)
    q = self.attn.queries(self.norm(h))

    def read(ids, logit_scale, value_scale, combine):
      k, v, ids = self.keys_values_in_use(bank, ids)
      slots = (per_position(x, routing, self.chunk, h.shape[1]) for x in (ids, logit_scale, value_scale))
      return routed_attention(q, k, v, *slots, combine=combine, implementation=self.attention_impl)

    if routing == "token":  # shared chapters: their own attention, weight 1; routed: one softmax each
      out = read(routed_ids, jnp.ones_like(routed_w), self.scaling * routed_w, "moe")
      if self.num_shared:
        shared = normalize_tokens(dequantize(bank[:self.num_shared]), self.token_norm, self.token_norm_eps)
        ks, vs = self.attn.keys_values(jnp.broadcast_to(shared.reshape(1, -1, shared.shape[-1]),
                                                        (q.shape[0], shared.shape[0] * shared.shape[1], shared.shape[-1])))
        out = out + attention(q, ks, vs).reshape(out.shape)
      chapters, weights = routed_ids, routed_w
    else:
      chapters, weights = with_shared(routed_ids, self.num_shared), mix_weights(routed_w, self.num_shared, self.scaling)
      out = read(chapters, weights, weights, "joint")
    stats.update(chapters=chapters, weights=weights)
    return self.attn.output(out, h.dtype), stats
