"""The memory read: chaptered bank, sequence router (top-k + aux losses), chapter mixing and
memory cross-attention — exactly as MoC-PT's paper path (reference_spec.md §1.3–§1.7, §3).

Order inside a memory layer: route on the *layer input* (before any norm) -> gather the shared
chapters then the routed ones -> parameter-free token norm -> scale every token by its chapter
weight -> K/V projections -> one joint softmax over all selected tokens -> zero-initialised W_o.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.model.chapter_read import read_chapters
from moc_jax.model.layers import attention, dense, param_init, rms_normalize, RMSNorm


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


def route(logits, num_shared, top_k):
  """MoC-PT sequence routing on router logits [B, C] (float32).

  Returns (probs [B,C] over all chapters, routed ids [B,k] in chapter space sorted by descending
  probability, routed weights [B,k] = softmax restricted to the selected set).
  MoC-PT renormalises probabilities twice (drop shared, keep top-k); that equals top-k on the routed
  logits and a softmax over the selected ones, which we compute directly: it stays finite when the
  shared chapter takes all the probability mass (the load-balance loss's degenerate minimum), where
  the renormalisation divides 0 by 0.
  """
  logits = logits.astype(jnp.float32)
  top_logits, top_idx = jax.lax.top_k(logits[:, num_shared:], top_k)
  return jax.nn.softmax(logits, axis=-1), top_idx + num_shared, jax.nn.softmax(top_logits, axis=-1)


def mix_weights(routed_weights, num_shared, scaling):
  """Chapter weights for [shared..., routed...]: raw [1,...,f*w...] divided by their sum (§1.5)."""
  b = routed_weights.shape[0]
  raw = jnp.concatenate([jnp.ones((b, num_shared), routed_weights.dtype), scaling * routed_weights], axis=-1)
  return raw / jnp.sum(raw, axis=-1, keepdims=True)


def router_losses(logits, probs, routed_ids):
  """Per-layer router statistics (§3): Switch load-balance (quirks kept), z-loss, MSE aux, entropy.

  f counts routed selections only, so shared chapters have f = 0 while P still includes them.
  """
  c = probs.shape[-1]
  f = jnp.mean(jnp.sum(jax.nn.one_hot(routed_ids, c, dtype=jnp.float32), axis=1), axis=0)
  f = jax.lax.stop_gradient(f)
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


class Router(nnx.Module):
  """One linear router per memory layer over all C chapters (bias included, as MoC-PT)."""

  def __init__(self, cfg, rngs):
    self.proj = dense(cfg.model.d_model, cfg.memory.num_chapters, cfg.model.init_std, ("embed", "chapter_logits"),
                      jnp.dtype(cfg.model.compute_dtype), rngs, bias=True)

  def __call__(self, h):
    """Sequence routing: plain mean over every position (pads and future tokens included)."""
    return self.proj(jnp.mean(h.astype(jnp.float32), axis=1)).astype(jnp.float32)


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

  def __call__(self, x, tokens):
    """x [B, L, d] (normed), tokens [B, N, mem_dim] already normalised and chapter-weighted."""
    b, l, _ = x.shape
    n = tokens.shape[1]
    q = self.q(x).reshape(b, l, self.num_heads, self.head_dim)
    k = self.k(tokens).reshape(b, n, self.num_kv_heads, self.head_dim)
    v = self.v(tokens).reshape(b, n, self.num_kv_heads, self.head_dim)
    return self.o(attention(q, k, v).astype(x.dtype))


class MemoryLayer(nnx.Module):
  """Router + memory norm + cross-attention for one memory layer.

  `route_input` is the layer input (the residual stream before the block's norms); `x` is the
  residual stream at the point the block reads memory.
  """

  def __init__(self, cfg, rngs):
    mem = cfg.memory
    self.num_shared, self.top_k = mem.num_shared, mem.top_k
    self.scaling = mem.routed_scaling_factor
    # MoC-PT skips the token norm when there are no shared chapters (or no routed ones).
    self.token_norm = mem.token_norm if mem.num_shared > 0 else "none"
    self.token_norm_eps = mem.token_norm_eps
    self.sharded_read = mem.sharded_read
    self.router = Router(cfg, rngs)
    self.norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)
    self.attn = MemoryCrossAttention(cfg, rngs)

  def select(self, route_input, bank):
    """Routes and gathers. bank [C, T, dm] -> (tokens [B, (s+k)*T, dm], chapters, weights, stats)."""
    logits = self.router(route_input)
    probs, routed_ids, routed_w = route(logits, self.num_shared, self.top_k)
    b = logits.shape[0]
    chapters = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(self.num_shared, dtype=routed_ids.dtype), (b, self.num_shared)), routed_ids], -1)
    weights = mix_weights(routed_w, self.num_shared, self.scaling)
    sel = read_chapters(bank, chapters, self.sharded_read)  # [B, s+k, T, dm]
    sel = normalize_tokens(sel.astype(jnp.float32), self.token_norm, self.token_norm_eps)
    sel = sel * weights[:, :, None, None]
    stats = router_losses(logits, probs, routed_ids)
    stats.update(chapters=chapters, weights=weights)
    return sel.reshape(b, -1, sel.shape[-1]), stats

  def __call__(self, h, route_input, bank):
    tokens, stats = self.select(route_input, bank)
    return self.attn(self.norm(h), tokens), stats
