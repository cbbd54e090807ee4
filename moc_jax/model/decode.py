"""Cached decoding: a fixed-size cache and a step that runs the model's own blocks on new positions.

One `step` serves the prompt (prefill, L = prompt length) and every later token (L = 1). Shapes never
change while decoding, so a jitted decode step compiles once. The cache is a pytree:

  index     int32 []         the slot the next position is written to
  valid     bool [B, M]      slots holding real tokens (not left padding, not yet written)
  position  int32 [B]        the next real token's RoPE position (real tokens so far)
  layers    per block of a layer group (leaves stacked [num_groups, ...] when the layers are scanned):
              k, v    [B, M, Hkv, dh]  self-attention keys and values, compute dtype
              memory  (memory blocks) the routing state of `memory.decode_routing`: {} until the
                      prompt has run; then prefix/chunk running sums, the rolling window, or the
                      prompt-routed chapters' keys and values (`MemoryLayer.decode`); pkm: {} (a token's
                      lookup needs no earlier one); hml: the memory block's own attention keys and values
                      {k, v}, shaped as the block's

Rows may be left-padded (`valid` False): padding is never attended to, never pooled for routing, and
takes no RoPE position, so a padded row decodes as it would alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def init_cache(model, batch: int, max_len: int) -> dict:
  """An empty cache of `max_len` slots for `batch` rows of `model` (a moc_jax Transformer)."""
  m, plan = model.cfg.model, model.plan
  lead = (plan.num_groups,) if plan.scanned else ()
  kv_shape = lead + (batch, max_len, m.num_kv_heads, m.d_model // m.num_heads)
  dtype = jnp.dtype(m.compute_dtype)

  def block(offset):
    c = {"k": jnp.zeros(kv_shape, dtype), "v": jnp.zeros(kv_shape, dtype)}
    if offset not in plan.memory_offsets:
      return c
    return {**c, "memory": dict(c) if model.cfg.memory.kind == "hml" else {}}

  return {"index": jnp.zeros((), jnp.int32), "valid": jnp.zeros((batch, max_len), bool),
          "position": jnp.zeros((batch,), jnp.int32), "layers": [block(j) for j in range(plan.period)]}


def step(model, cache: dict, ids, valid=None):
  """Runs ids [B, L] (`valid` [B, L] marks real tokens; default all) at the cache's next L slots.

  Returns (updated cache, logits [B, L, V] float32). The caller keeps index + L <= max_len.
  """
  valid = jnp.ones(ids.shape, bool) if valid is None else valid.astype(bool)
  index, slots = cache["index"], cache["valid"].shape[1]
  seen = jax.lax.dynamic_update_slice_in_dim(cache["valid"], valid, index, axis=1)
  counts = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
  positions = cache["position"][:, None] + counts - valid
  causal = jnp.arange(slots)[None, :] <= index + jnp.arange(ids.shape[1])[:, None]  # [L, M]
  mask = seen[:, None, None, :] & causal[None, None]
  layers, logits = model.forward_cached(cache["layers"], ids, positions, mask, valid, index)
  return {"index": index + ids.shape[1], "valid": seen, "position": cache["position"] + counts[:, -1],
          "layers": layers}, logits

