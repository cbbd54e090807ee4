"""One entry point for attention from every token to its own routed chapters.

Contract (shared by every implementation):
  q            [B, L, H, dh]     queries (any float dtype; scores and softmax accumulate in float32)
  k, v         [C, T, Hkv, dh]   per-layer keys/values of the chapters in use, projected once per step
  ids          [B, L, S] int32   chapter of slot s for token (b, l); -1 = empty slot (reads nothing)
  logit_scale  [B, L, S]         multiplies slot s's logits q.k/sqrt(dh)
  value_scale  [B, L, S]         multiplies slot s's values
  combine      "joint": one softmax over the tokens of all slots (sequence / prefix / chunk routing,
                        where a chapter weight scales its keys and values);
               "moe":   a softmax per slot, outputs summed (token routing).
Query head h reads kv head h // (H / Hkv). Returns float32 [B, L, H, dh]; a token whose slots are all
empty gets zeros. `return_lse` (joint only) also returns the float32 log-sum-exp [B, L, H] of the joint
logits (-1e30 where every slot is empty), differentiable, so that partial results over disjoint chapter
sets (a sharded bank) merge exactly.

`implementation`: "reference" (gathered oracle), "xla" (never gathers keys per (token, slot)),
"pallas" (TPU Mosaic / GPU kernels, interpret mode on CPU), "auto" (pallas on TPU/GPU, xla elsewhere).
"""
from __future__ import annotations

import jax

from kernels_pallas.routed_chapter_attention import reference

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")
COMBINES = ("joint", "moe")


def check_shapes(q, k, v, ids, logit_scale, value_scale, combine):
  """Raises ValueError naming the argument whose shape or value breaks the contract."""
  if combine not in COMBINES:
    raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"q must be [B,L,H,dh] and k, v equal [C,T,Hkv,dh]; got {q.shape}, {k.shape}, {v.shape}")
  if q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"head_dim must match and H={q.shape[2]} be a multiple of Hkv={k.shape[2]}")
  if ids.shape[:2] != q.shape[:2] or ids.ndim != 3:
    raise ValueError(f"ids must be [B, L, S] with B, L of q {q.shape[:2]}; got {ids.shape}")
  for name, x in (("logit_scale", logit_scale), ("value_scale", value_scale)):
    if x.shape != ids.shape:
      raise ValueError(f"{name} must have the shape of ids {ids.shape}; got {x.shape}")


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, *, combine="joint",
                             implementation="auto", interpret=None, return_lse=False):
  check_shapes(q, k, v, ids, logit_scale, value_scale, combine)
  if return_lse and combine != "joint":
    raise ValueError("return_lse is defined for combine='joint' only")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "auto":
    implementation = "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
  if implementation == "reference":
    return reference.routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, return_lse)
  if implementation == "xla":
    from kernels_pallas.routed_chapter_attention import xla
    return xla.routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, return_lse=return_lse)
  from kernels_pallas.routed_chapter_attention import pallas
  return pallas.routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine,
                                         interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
                                         return_lse=return_lse)
