"""Optax optimizer with MoC-PT's semantics (docs/mocpt_semantics.md).

AdamW(b1, b2, eps) with decoupled weight decay on every parameter, global-norm clipping of the full
gradient, and three parameter groups (base / memory layers / bank), each with its own peak LR, all
following one schedule multiplier λ(s). The n-th update uses λ(n-1), so the first update has lr 0
for warm-up schedules, exactly as MoC-PT's LambdaLR.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moc_jax.model.build import param_groups

GROUPS = ("base", "memory", "bank")


def schedule_multiplier(t) -> callable:
  """λ(s) for config.train `t`: wsd | cosine | linear | constant (MoC-PT utils.py; docs/mocpt_semantics.md#lr-schedules)."""
  total, warmup, r = t.steps, t.warmup_steps, t.min_lr_ratio
  if t.schedule == "constant":  # HF get_scheduler("constant") ignores warm-up
    return lambda s: jnp.ones_like(jnp.asarray(s, jnp.float32))
  decay_start = decay_start_step(t)

  def decay(s):  # from 1 at the decay start: cosine to r (cosine, wsd), or linear to 0 ignoring r (MoC-PT's)
    if t.schedule == "linear":
      return jnp.maximum(0.0, (total - s) / max(total - decay_start, 1))
    progress = (s - decay_start) / max(total - decay_start, 1)
    return r + (1 - r) * 0.5 * (1 + jnp.cos(math.pi * progress))

  def multiplier(s):  # warm-up, hold at the peak until the decay start, decay
    s = jnp.asarray(s, jnp.float32)
    return jnp.where(s < warmup, s / max(warmup, 1), jnp.where(s < decay_start, 1.0, decay(s)))
  return multiplier


def decay_start_step(t) -> int:
  """MoC-PT's rule for wsd, cosine and linear alike: decay_start_step wins over decay_start_ratio; without
  either the decay starts at W (no hold); the result is clamped to [W, steps]."""
  if t.decay_start_step is not None:
    start = t.decay_start_step
  elif t.decay_start_ratio is not None:
    start = int(t.steps * t.decay_start_ratio)
  else:
    start = t.warmup_steps
  return max(t.warmup_steps, min(start, t.steps))


def group_lrs(t) -> dict[str, float]:
  return {"base": t.base_lr, "memory": t.memory_lr,
          "bank": t.memory_lr if t.bank_lr is None else t.bank_lr}


def group_labels(params):
  """Same-structure tree of 'base' | 'memory' | 'bank' labels for an nnx.State of params."""
  return nnx.map_state(lambda path, _: param_groups(path), params)


def make_optimizer(t, params) -> optax.GradientTransformation:
  """The full update rule; `freeze_bank` drops the bank from the optimizer (no Adam state, no update)."""
  lam = schedule_multiplier(t)
  lrs = group_lrs(t)

  def group_tx(lr):
    return optax.chain(
        optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
        optax.add_decayed_weights(t.weight_decay),
        optax.scale_by_schedule(lambda s: -lr * lam(s)))

  transforms = {g: group_tx(lrs[g]) for g in GROUPS}
  if t.freeze_bank:
    transforms["bank"] = optax.set_to_zero()
  labels = group_labels(params)
  if "fixed" in jax.tree.leaves(labels):  # the aux-free balance bias: no gradient step, no weight decay
    transforms["fixed"] = optax.set_to_zero()
  chain = [optax.clip_by_global_norm(t.clip_norm)] if t.clip_norm > 0 else []
  return optax.chain(*chain, optax.multi_transform(transforms, labels))


def current_lrs(t, update_count) -> dict[str, float]:
  """The LR each group used for update number `update_count` (0-based), for logging."""
  lam = float(schedule_multiplier(t)(update_count))
  return {g: lr * lam * (0.0 if g == "bank" and t.freeze_bank else 1.0) for g, lr in group_lrs(t).items()}
