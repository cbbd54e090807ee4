"""Optax optimizer with MoC-PT's semantics (docs/mocpt_semantics.md).

AdamW(b1, b2, eps) with decoupled weight decay on every parameter, global-norm clipping of the full
gradient, and three parameter groups (base / memory layers / bank), each with its own peak LR, all
following one schedule multiplier λ(s). The n-th update uses λ(n-1), so the first update has lr 0
for warm-up schedules, exactly as MoC-PT's LambdaLR.

`train.bank_optimizer=lazy_adam` replaces the bank group's AdamW by `lazy_adamw`: AdamW over the chapters
an update read (given as the `chapter_mask` extra argument of `tx.update`, see `chapters_read`), the other
chapters' values and moments untouched. `train.bank_optimizer=smf` (sparse memory finetuning) is the same
update over another set of chapters: per bank the `train.smf_top_t` chapters the update read most against a
background (`smf_chapters`). Neither is MoC-PT's semantics; `dense` (the default) is.
"""
from __future__ import annotations

import math
from typing import NamedTuple

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


class LazyAdamState(NamedTuple):
  """`lazy_adamw`'s state. `count`: per chapter, the updates that read it, int32 [banks, chapters] for each
  bank leaf, in a tree shaped like the parameters so that the chapter padding (padding.py: axis 1 under
  `bank/memory`) and the shardings (logical names ("banks", "chapters")) treat it as they treat the moments.
  `mu`, `nu`: Adam's moments, like the parameters."""
  count: optax.Updates
  mu: optax.Updates
  nu: optax.Updates


def _chapter_counts(p):
  """Zero counts [banks, chapters] for a bank leaf [banks, chapters, ...]; an nnx Variable keeps the first two
  of its parameter's logical axis names, so the counts shard along the chapters as the bank does."""
  counts = jnp.zeros(p.shape[:2], jnp.int32)
  if not isinstance(p, nnx.Variable):
    return counts
  names = p.get_metadata().get("out_sharding")
  return p.replace(counts, out_sharding=None if names is None else tuple(names[:2]))


def _lazy_adamw_leaf(g, m, v, count, p, read, b1, b2, eps, weight_decay):
  """One bank leaf [banks, chapters, ...]: AdamW (the formulas of optax.scale_by_adam and add_decayed_weights)
  where `read` [banks, chapters] is set, with the chapter's own step count in the bias correction; elsewhere
  a zero update and m, v, count as they were. -> (update, m, v, count)."""
  count = count + read.astype(count.dtype)
  read = read.reshape(read.shape + (1,) * (g.ndim - 2))
  m = jnp.where(read, (1 - b1) * g + b1 * m, m)
  v = jnp.where(read, (1 - b2) * (g ** 2) + b2 * v, v)
  steps = jnp.maximum(count, 1).reshape(read.shape)  # a never-read chapter divides by 1 - b**1, not by 0
  m_hat = m / (1 - b1 ** steps).astype(m.dtype)
  v_hat = v / (1 - b2 ** steps).astype(v.dtype)
  return jnp.where(read, m_hat / (jnp.sqrt(v_hat) + eps) + weight_decay * p, 0), m, v, count


def lazy_adamw(b1, b2, eps, weight_decay) -> optax.GradientTransformationExtraArgs:
  """AdamW over chapters for the bank group: `update(g, state, params, chapter_mask=...)`, `chapter_mask`
  bool [banks, chapters] (the padded chapter axis) marking the chapters this update moves.

  A marked chapter takes one AdamW step: its moments absorb its gradient, its bias correction uses its own
  count of marked updates (a chapter read for the first time at update 500 is corrected as at step 1), and
  decoupled weight decay applies. An unmarked chapter keeps its value, moments and count bit for bit: its
  weight decay is skipped, not caught up later, because catching up exactly needs the LR of every skipped
  update (torch SparseAdam and TF LazyAdam skip it too). The caller's scale (the schedule LR) follows.

  Step 1 of the sparse bank update: the semantics, computed as a masked elementwise update over the whole
  bank (jnp.where), so it costs what dense AdamW costs. Gathering and scattering only the marked chapters
  (with a sparse gradient) is the later step; the mask also serves any other choice of chapters to train.
  """
  def init_fn(params):
    counts = jax.tree.map(_chapter_counts, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return LazyAdamState(count=counts, mu=optax.tree.zeros_like(params), nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params, *, chapter_mask):
    grads, treedef = jax.tree.flatten(updates)
    counts, counts_def = jax.tree.flatten(state.count)
    out = [_lazy_adamw_leaf(g, m, v, n, p, chapter_mask, b1, b2, eps, weight_decay) for g, m, v, n, p in
           zip(grads, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), counts, jax.tree.leaves(params))]
    new, m, v, n = zip(*out)
    return treedef.unflatten(new), LazyAdamState(count=counts_def.unflatten(n), mu=treedef.unflatten(m),
                                                 nu=treedef.unflatten(v))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def chapters_read(load, bank_ids, num_shared, chapters):
  """The chapter mask of an update, bool [banks, chapters]: the chapters any routing decision selected
  (`load` [memory layers, C], routed selections per chapter summed over the update's micro-batches; memory
  layer i reads bank `bank_ids[i]`), every shared chapter (always read), and never the chapters padded for
  sharding (`chapters` - C of them, at the end)."""
  banks = max(bank_ids) + 1
  routed = jax.ops.segment_sum(load, jnp.asarray(bank_ids), num_segments=banks) > 0
  read = routed | (jnp.arange(load.shape[-1]) < num_shared)
  return jnp.pad(read, ((0, 0), (0, chapters - load.shape[-1])))


def smf_chapters(read, bank_ids, idf, top_t, chapters):
  """Sparse memory finetuning's chapter mask, bool [banks, chapters]: per bank the `top_t` chapters of highest
  TF-IDF score tf·idf, where tf [memory layers, C] is how much the update read each chapter (chapter weights
  summed over its decisions and micro-batches; `model.routing.read_weight`), summed over the layers reading the
  bank, and idf [banks, C] (`bank_background.idf`) is high for chapters pre-training rarely read. Ties (e.g.
  unread chapters at score 0 when fewer than top_t were read) go to the lower chapter id; the chapters padded
  for sharding (`chapters` - C, at the end) are never chosen."""
  banks, c = idf.shape
  tf = jax.ops.segment_sum(read, jnp.asarray(bank_ids), num_segments=banks)
  score = jnp.pad(tf * idf, ((0, 0), (0, chapters - c)), constant_values=-jnp.inf)
  _, top = jax.lax.top_k(score, top_t)
  return jnp.zeros((banks, chapters), bool).at[jnp.arange(banks)[:, None], top].set(True)


def make_optimizer(t, params) -> optax.GradientTransformationExtraArgs:
  """The full update rule; `freeze_bank` drops the bank from the optimizer (no Adam state, no update);
  `bank_optimizer=lazy_adam` / `smf` needs `tx.update(..., chapter_mask=chapters_read(...) / smf_chapters(...))`: optax's chain and
  multi_transform hand extra arguments to every group, and the groups other than lazy_adamw ignore them."""
  lam = schedule_multiplier(t)
  lrs = group_lrs(t)

  def group_tx(lr, *direction):
    return optax.chain(*direction, optax.scale_by_schedule(lambda s: -lr * lam(s)))

  adamw = (optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps), optax.add_decayed_weights(t.weight_decay))
  transforms = {g: group_tx(lrs[g], *adamw) for g in GROUPS}
  if t.freeze_bank:
    transforms["bank"] = optax.set_to_zero()
  elif t.bank_optimizer in ("lazy_adam", "smf"):
    transforms["bank"] = group_tx(lrs["bank"], lazy_adamw(t.b1, t.b2, t.eps, t.weight_decay))
  labels = group_labels(params)
  if "fixed" in jax.tree.leaves(labels):  # the aux-free balance bias: no gradient step, no weight decay
    transforms["fixed"] = optax.set_to_zero()
  chain = [optax.clip_by_global_norm(t.clip_norm)] if t.clip_norm > 0 else []
  return optax.chain(*chain, optax.multi_transform(transforms, labels))


def current_lrs(t, update_count) -> dict[str, float]:
  """The LR each group used for update number `update_count` (0-based), for logging."""
  lam = float(schedule_multiplier(t)(update_count))
  return {g: lr * lam * (0.0 if g == "bank" and t.freeze_bank else 1.0) for g, lr in group_lrs(t).items()}
