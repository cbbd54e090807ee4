"""The contract every implementation of routed chapter attention meets, and the argument checks they share.

It lives in its own module, below every implementation, so that the implementations and the `api` that
chooses among them all import it and none of them imports another one for it.

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
logits (NEG_INF where every slot is empty), differentiable, so that partial results over disjoint chapter
sets (a sharded bank) merge exactly.
"""
from __future__ import annotations

import jax

COMBINES = ("joint", "moe")
# The log-sum-exp of a token whose slots are all empty. Finite, so that merging it with other partial
# results (max, exp of differences) stays free of NaN, and far enough below any real logit to weigh zero.
NEG_INF = -1e30


def target_platform() -> str:
  """The platform the code being traced will run on: that of the devices of the mesh it is traced under, else JAX's
  default backend. They differ when a step is compiled for a TPU slice's devices on a host without one
  (`python -m moc_jax.compile_report --topology=...`): the kernels must then be chosen and lowered for the TPU."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


def check_combine(combine, return_lse=False):
  """Raises ValueError unless `combine` is one of COMBINES and `return_lse` is asked of "joint" only:
  "moe" has no joint normaliser to return."""
  if combine not in COMBINES:
    raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
  if return_lse and combine != "joint":
    raise ValueError("return_lse is defined for combine='joint' only")


def check_arguments(q, k, v, ids, logit_scale, value_scale, combine, return_lse=False):
  """`check_combine`, then the shapes: raises ValueError naming the argument that breaks the contract."""
  check_combine(combine, return_lse)
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"q must be [B,L,H,dh] and k, v equal [C,T,Hkv,dh]; got {q.shape}, {k.shape}, {v.shape}")
  if q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
    raise ValueError(f"head_dim must match and H={q.shape[2]} be a multiple of Hkv={k.shape[2]}")
  if ids.shape[:2] != q.shape[:2] or ids.ndim != 3:
    raise ValueError(f"ids must be [B, L, S] with B, L of q {q.shape[:2]}; got {ids.shape}")
  for name, x in (("logit_scale", logit_scale), ("value_scale", value_scale)):
    if x.shape != ids.shape:
      raise ValueError(f"{name} must have the shape of ids {ids.shape}; got {x.shape}")
