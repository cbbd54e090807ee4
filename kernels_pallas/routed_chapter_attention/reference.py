"""The test oracle: gather every (token, slot) chapter's keys and values, then plain softmax attention.

Materialises [B, L, S, T, Hkv, dh] keys and values — obviously correct, hopeless at scale. It shares no
code with the other implementations beyond the contract, so that a bug in their plan or merge cannot
hide in the oracle as well.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.routed_chapter_attention.contract import NEG_INF, check_combine


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, return_lse=False):
  """See `contract`. Returns float32 [B, L, H, dh] (and, with `return_lse`, the joint logits'
  log-sum-exp [B, L, H])."""
  check_combine(combine, return_lse)
  b, l, h, dh = q.shape
  hkv = k.shape[2]
  valid = ids >= 0
  kg = jnp.take(k, jnp.maximum(ids, 0), axis=0)  # [B, L, S, T, Hkv, dh]
  vg = jnp.take(v, jnp.maximum(ids, 0), axis=0)
  qg = q.reshape(b, l, hkv, h // hkv, dh)
  scores = jnp.einsum("blkgd,blstkd->blkgst", qg, kg, preferred_element_type=jnp.float32)
  scores = scores * (logit_scale.astype(jnp.float32) / jnp.sqrt(jnp.float32(dh)))[:, :, None, None, :, None]
  scores = jnp.where(valid[:, :, None, None, :, None], scores, NEG_INF)
  if combine == "joint":
    flat = scores.reshape(b, l, hkv, h // hkv, -1)
    probs = jax.nn.softmax(flat, axis=-1).reshape(scores.shape)
    lse = jnp.where(jnp.any(valid, -1)[:, :, None, None], jax.nn.logsumexp(flat, axis=-1), NEG_INF)
  else:
    probs = jax.nn.softmax(scores, axis=-1)
  weight = jnp.where(valid, value_scale.astype(jnp.float32), 0.0)[:, :, None, None, :, None]
  out = jnp.einsum("blkgst,blstkd->blkgd", probs * weight, vg.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
  out = out.reshape(b, l, h, dh)
  if return_lse:
    return out, lse.reshape(b, l, h)
  return out
