"""The jitted train and eval steps: pure functions of (params, opt_state, batch).

One `jax.jit` over the split NNX state with explicit shardings and the state donated. Gradient
accumulation is a scan over micro-batches whose loss is the mean of micro-batch token means (MoC-PT).
A non-finite loss or gradient norm skips the update (state unchanged) and is counted.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moc_jax.losses import lm_loss

def _freeze_bank(params):
  return nnx.map_state(lambda path, v: jax.lax.stop_gradient(v) if "bank" in map(str, path) else v, params)


def make_train_step(graphdef, tx, config):
  accum, freeze = config.train.grad_accum, config.train.freeze_bank

  def loss_fn(params, batch):
    if freeze:
      params = _freeze_bank(params)
    loss, (ce, aux) = lm_loss(nnx.merge(graphdef, params), batch, train=True)
    stats = {"ce": ce, "aux": aux["router_loss"]}
    if "entropy" in aux:
      stats["router_entropy"] = jnp.mean(aux["entropy"])
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
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
    old = {"params": params, "opt_state": state["opt_state"]}
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    nonfinite = jnp.where(ok, 0, state["nonfinite"] + 1)
    new_state = {**state, **new, "step": state["step"] + 1, "nonfinite": nonfinite,
                 "skipped": state["skipped"] + (~ok).astype(jnp.int32)}
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite, **stats}
    return new_state, metrics

  return train_step


def jit_train_step(graphdef, tx, config, shardings, batch_sharding):
  """The one jitted train step: explicit state/batch shardings, the state donated."""
  return jax.jit(make_train_step(graphdef, tx, config), in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, None), donate_argnums=0)
