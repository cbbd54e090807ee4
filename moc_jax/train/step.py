"""The jitted train and eval steps: pure functions of (params, opt_state, batch).

One `jax.jit` over the split NNX state with explicit shardings and the state donated. Gradient
accumulation is a scan over micro-batches whose loss is the mean of micro-batch token means (MoC-PT).
A non-finite loss or gradient norm skips the update (state unchanged) and is counted.

Router balancing under accumulation: a load-balance loss term is a function of one micro-batch's decisions
(every device's rows: the step sees the global micro-batch), as MoC-PT computes it; its gradient is
accumulated like the CE's. The aux-free bias moves once per update, on the routed selections summed over
every micro-batch of the update, so the balance it targets is the update's, whatever grad_accum is.

With `train.bank_optimizer=lazy_adam` the optimizer moves the chapters the update read: those routed
selections (any decision of any micro-batch, every device's rows) and the shared chapters
(`optim.chapters_read`), handed to `tx.update` as its `chapter_mask`. With `smf` the mask is the top-t
chapters by TF-IDF (`optim.smf_chapters`): how much the update read each chapter (chapter weights summed over
every micro-batch) against the background's `idf`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moc_jax.config import bank_ids
from moc_jax.losses import lm_loss
from moc_jax.optim import chapters_read, smf_chapters
from moc_jax.model.routing import balance_bias_step, read_weight
from moc_jax.router_health import STEP_STATS

def _freeze_bank(params):
  return nnx.map_state(lambda path, v: jax.lax.stop_gradient(v) if "bank" in map(str, path) else v, params)


def _move_balance_bias(graphdef, params, load, mem):
  """Aux-free balancing after an update: every bias moves by rate * sign(mean load - load), the loads being
  the routed selections of the whole update (all micro-batches; all devices, as the step sees the global
  batch)."""
  model = nnx.merge(graphdef, params)
  model.shift_balance_bias(balance_bias_step(load, mem.num_shared, mem.aux_free_rate))
  return nnx.state(model, nnx.Param)


def _optimizer_args(config, params, stats, idf):
  """Extra arguments of `tx.update`: the chapter mask for lazy_adam and smf, nothing for the dense bank."""
  t = config.train
  if t.bank_optimizer == "dense":
    return {}
  chapters = params["bank"]["memory"].shape[1]  # padded for sharding: those chapters are never read
  if t.bank_optimizer == "smf":
    return {"chapter_mask": smf_chapters(stats["router_read"], bank_ids(config), idf, t.smf_top_t, chapters)}
  return {"chapter_mask": chapters_read(stats["router_load"], bank_ids(config), config.memory.num_shared, chapters)}


def _decision_mask(chapters, batch):
  """The non-pad decisions of per-position routing ([n_mem, B, L, s+k] chapters); None for per-row / per-chunk."""
  mask = batch.get("attention_mask")
  if mask is None or chapters.ndim != 4 or chapters.shape[2] != mask.shape[1]:
    return None
  return mask


def make_train_step(graphdef, tx, config, idf=None):
  """`idf` [banks, chapters]: the background of `bank_optimizer=smf` (bank_background.idf)."""
  accum, freeze = config.train.grad_accum, config.train.freeze_bank
  smf = config.train.bank_optimizer == "smf"
  if smf and idf is None:
    raise ValueError("bank_optimizer=smf needs the background's idf")
  mem = config.memory

  def loss_fn(params, batch):
    if freeze:
      params = _freeze_bank(params)
    loss, (ce, aux) = lm_loss(nnx.merge(graphdef, params), batch, train=True)
    stats = {"ce": ce, "aux": aux["router_loss"]}
    if "entropy" in aux:
      stats["router_entropy"] = jnp.mean(aux["entropy"])
      stats["router_load"] = aux["load"] * accum  # summed over the update's micro-batches below
      stats.update({f"router_{k}": aux[k] for k in STEP_STATS if k in aux})
      if smf:
        read = read_weight(aux["chapters"], aux["weights"], mem.num_chapters, _decision_mask(aux["chapters"], batch))
        stats["router_read"] = read * accum
    return loss, stats

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state, batch):
    params = state["params"]
    micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

    def body(acc, mb):
      out = grad_fn(params, mb)
      return jax.tree.map(jnp.add, acc, out), None

    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro)))
    ((loss, stats), grads), _ = jax.lax.scan(body, zero, micro)
    loss, stats, grads = jax.tree.map(lambda x: x / accum, (loss, stats, grads))
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], params, **_optimizer_args(config, params, stats, idf))
    new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
    if mem.enabled and mem.load_balance == "aux_free" and "router_load" in stats:
      new["params"] = _move_balance_bias(graphdef, new["params"], stats["router_load"], mem)
    old = {"params": params, "opt_state": state["opt_state"]}
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    nonfinite = jnp.where(ok, 0, state["nonfinite"] + 1)
    new_state = {**state, **new, "step": state["step"] + 1, "nonfinite": nonfinite,
                 "skipped": state["skipped"] + (~ok).astype(jnp.int32)}
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite, **stats}
    return new_state, metrics

  return train_step


def jit_train_step(graphdef, tx, config, shardings, batch_sharding, idf=None):
  """The one jitted train step: explicit state/batch shardings, the state donated."""
  return jax.jit(make_train_step(graphdef, tx, config, idf), in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, None), donate_argnums=0)
