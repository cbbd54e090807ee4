"""Routing decisions: what each decision sees (a row's mean, a position, a prefix, a chunk; in training and in
cached decoding), the router, top-k selection, chapter weights and the router's auxiliary losses.

MoC-PT's rules (docs/mocpt_semantics.md): softmax over all chapters, top-k over the routed ones, weights
renormalised over the selected set, shared chapters first with raw weight 1 and routed ones with
`routed_scaling_factor * w`, all divided by their sum.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.config.schema import CAUSAL_ROUTINGS
from moc_jax.model.layers import dense


def resolve_decode_routing(mem):
  """`memory.decode_routing` with `auto` resolved: the training routing when it is causal (cached
  decoding then equals a full forward), `sequence` (routed once on the prompt) otherwise."""
  if mem.decode_routing != "auto":
    return mem.decode_routing
  return mem.routing if mem.routing in CAUSAL_ROUTINGS else "sequence"


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
  """Chapter weights for [shared..., routed...]: raw [1,...,f*w...] divided by their sum (MoC-PT's mixing)."""
  ones = jnp.ones(routed_weights.shape[:-1] + (num_shared,), routed_weights.dtype)
  raw = jnp.concatenate([ones, scaling * routed_weights], axis=-1)
  return raw / jnp.sum(raw, axis=-1, keepdims=True)


def with_shared(routed_ids, num_shared):
  """Chapter list [shared 0..s-1, routed...] for every decision."""
  shared = jnp.arange(num_shared, dtype=routed_ids.dtype)
  return jnp.concatenate([jnp.broadcast_to(shared, routed_ids.shape[:-1] + (num_shared,)), routed_ids], -1)


def router_losses(logits, probs, routed_ids):
  """Per-layer router statistics (MoC-PT's losses): Switch load-balance (quirks kept), z-loss, MSE aux, entropy.

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


def cached_routing_input(state, h, valid, routing, chunk, index):
  """`routing_input` of the positions at slots index, index+1, ... of a row whose earlier layer inputs
  `state` summarises ({} before the first call) -> (new state, per-position routing inputs [B, L, d]).
  prefix keeps the running masked sum and count of the inputs; chunk also keeps them as of the
  current chunk's start; token keeps nothing."""
  h = h.astype(jnp.float32)
  if routing == "token":
    return {}, h
  b, l, d = h.shape
  w = valid.astype(jnp.float32)
  total0, count0 = state.get("total", jnp.zeros((b, d))), state.get("count", jnp.zeros((b,)))
  # running sums over the slots before index + j, j = 0..L
  total = jnp.concatenate([total0[:, None], total0[:, None] + jnp.cumsum(h * w[..., None], axis=1)], axis=1)
  count = jnp.concatenate([count0[:, None], count0[:, None] + jnp.cumsum(w, axis=1)], axis=1)
  new = {"total": total[:, -1], "count": count[:, -1]}
  if routing == "prefix":
    return new, total[:, 1:] / jnp.maximum(count[:, 1:, None], 1.0)
  # chunk: the sums before each slot's chunk start; a chunk that began before this call uses the saved ones
  start = (index + jnp.arange(l + 1)) // chunk * chunk - index
  inside = start >= 0
  total = jnp.where(inside[None, :, None], jnp.take(total, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_total", jnp.zeros((b, d)))[:, None])
  count = jnp.where(inside[None, :], jnp.take(count, jnp.maximum(start, 0), axis=1),
                    state.get("chunk_count", jnp.zeros((b,)))[:, None])
  new.update(chunk_total=total[:, -1], chunk_count=count[:, -1])
  return new, total[:, :-1] / jnp.maximum(count[:, :-1, None], 1.0)


def cached_decision_input(state, h, valid, routing, window):
  """One routing decision per cached-decoding call for the decode-only strategies -> (new state, pooled
  [B, d]). sequence: the masked mean of the call's (the prompt's) inputs, no state (the memory layer keeps
  the chapters it chose instead); rolling: the masked mean of the last `window` layer inputs, this call's
  included, kept in the state; hybrid: the first call (the prompt) routes on its own masked mean and seeds
  the window, later calls as rolling (MoC-PT's)."""
  if routing == "sequence":
    return state, masked_mean(h, valid)
  b, _, d = h.shape
  recent = jnp.concatenate([state.get("window", jnp.zeros((b, window, d))), h.astype(jnp.float32)], axis=1)[:, -window:]
  seen = jnp.concatenate([state.get("seen", jnp.zeros((b, window), bool)), valid], axis=1)[:, -window:]
  first_hybrid = routing == "hybrid" and not state
  pooled = masked_mean(h, valid) if first_hybrid else masked_mean(recent, seen)
  return {"window": recent, "seen": seen}, pooled


class Router(nnx.Module):
  """One linear router per memory layer over all C chapters (bias included, as MoC-PT)."""

  def __init__(self, cfg, rngs):
    self.proj = dense(cfg.model.d_model, cfg.memory.num_chapters, cfg.model.init_std, ("embed", "chapter_logits"),
                      jnp.dtype(cfg.model.compute_dtype), rngs, bias=True)

  def __call__(self, pooled):
    """Logits [..., C] (float32) of routing inputs [..., d] (see `routing_input`)."""
    return self.proj(pooled).astype(jnp.float32)
