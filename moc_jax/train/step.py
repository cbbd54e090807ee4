"""The jitted train and eval steps: pure functions of (params, opt_state, batch).

One `jax.jit` over the split NNX state with explicit shardings and the state donated. Gradient
accumulation is a scan over micro-batches whose loss is the mean of micro-batch token means (MoC-PT).
A non-finite loss or gradient norm skips the update (state unchanged) and is counted.

Router balancing under accumulation: a load-balance loss term is a function of one micro-batch's decisions
(every device's rows: the step sees the global micro-batch), as MoC-PT computes it; its gradient is
accumulated like the CE's. The aux-free bias moves once per update, on the routed selections summed over
every micro-batch of the update, so the balance it targets is the update's, whatever grad_accum is.

With `train.bank_optimizer=lazy_adam` the optimizer (`optim.LazyBankOptimizer`) moves the chapters the
update read: those routed selections (any decision of any micro-batch, every device's rows) and the shared
chapters (`optim.chapters_read`). The bank's gradient is then sparse: each memory layer reads its bank through
zero deltas on the rows it uses (`model.memory.BankRows`), the step differentiates the deltas instead of the
bank, and the update gathers, steps and scatters only those rows, so no bank-sized array is built or touched
(a chapter-sharded bank takes the dense gradient and the masked update, each device over its own chapters).
With `smf` the mask is the top-t chapters by TF-IDF (`optim.smf_chapters`): how much the update read each
chapter (chapter weights summed over every micro-batch) against the background's `idf`; its gradient is dense.
A product-key value table (memory.kind pkm / hml) is the bank too, a slot a row: its sparse gradient names the
slots the lookups read, and a sharded table's masked update moves the slots any lookup of the update named.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moc_jax.config import bank_ids, bank_shape, reads_chapters
from moc_jax.losses import lm_loss
from moc_jax.optim import SparseRows, bank_update, chapters_read, frozen_groups, smf_chapters, split_bank, without_bank
from moc_jax.model.build import param_groups
from moc_jax.model.routing import balance_bias_step, read_weight
from moc_jax.router_health import STEP_STATS
from moc_jax.sharding import current


def _stop_frozen(params, groups):
  """The parameters of the frozen `groups` (optim.frozen_groups) as constants: no gradient reaches them, so the
  gradient norm and its clipping are the trained parameters'."""
  return nnx.map_state(lambda path, v: jax.lax.stop_gradient(v) if param_groups(path) in groups else v, params)


def _move_balance_bias(graphdef, params, load, mem, ok):
  """Aux-free balancing after an update: every bias moves by rate * sign(mean load - load), the loads being
  the routed selections of the whole update (all micro-batches; all devices, as the step sees the global
  batch); not at all when the update is skipped (`ok` false)."""
  model = nnx.merge(graphdef, params)
  step = balance_bias_step(load, mem.num_shared, mem.aux_free_rate)
  model.shift_balance_bias(jnp.where(ok, step, jnp.zeros_like(step)))
  return nnx.state(model, nnx.Param)


def _row_mask(config, bank, params, stats, idf, step):
  """The rows a lazy `bank` update moves, bool [banks, rows] (padded for sharding: those rows are never read), or
  None: a product-key table's sparse gradient names them itself (`optim.LazyBankOptimizer.apply`)."""
  chapters = params["bank"]["memory"].shape[1]
  if bank.smf:
    key = jax.random.fold_in(jax.random.key(config.seed), step)  # smf_rank=random: a draw per update
    return smf_chapters(stats["router_read"], bank_ids(config), idf, bank.top_t, chapters, bank.rank, key)
  if reads_chapters(config):
    return chapters_read(stats["router_load"], bank_ids(config), config.memory.num_shared, chapters)
  return None if "slots_read" not in stats else stats["slots_read"] > 0


def _slots_read(slots, ids_of, rows):
  """How often each value slot was read, [banks, rows] float32, from the lookups' slots [n_mem, ...] (memory
  layer i reads bank `ids_of[i]`)."""
  out = jnp.zeros((max(ids_of) + 1, rows), jnp.float32)
  for i, b in enumerate(ids_of):
    out = out.at[b, slots[i].reshape(-1)].add(1.0)
  return out


def _decision_mask(chapters, batch):
  """The non-pad decisions of per-position routing ([n_mem, B, L, s+k] chapters); None for per-row / per-chunk."""
  mask = batch.get("attention_mask")
  if mask is None or chapters.ndim != 4 or chapters.shape[2] != mask.shape[1]:
    return None
  return mask


def _sparse_bank(bank, config):
  """Whether this trace takes the bank's gradient sparse (`BankRows`): a `bank` update that can, on a bank whose
  row axis (chapters, slots) is not split over devices (a sharded bank takes the masked update, shard by shard)."""
  return bank.sparse_gradient and not current(bank_shape(config).row_axis)[0]


def _rows_per_bank(rows, grads, ids_of, chapters):
  """The update's sparse bank gradient, one `optim.SparseRows` per bank: the rows every memory layer and
  micro-batch read ([accum, n_mem, K] chapter ids, [accum, n_mem, K, T, dm] their gradients; memory layer i
  reads bank `ids_of[i]`), duplicates summed."""
  out = []
  for b in range(max(ids_of) + 1):
    layers = [i for i, x in enumerate(ids_of) if x == b]
    ids, values = rows[:, layers].reshape(-1), grads[:, layers].reshape(-1, *grads.shape[3:])
    size = min(ids.size, chapters + 1)
    used, inverse = jnp.unique(ids, size=size, fill_value=chapters, return_inverse=True)
    out.append(SparseRows(used, jax.ops.segment_sum(values, inverse.reshape(-1), num_segments=size)))
  return out


def bank_delta_shape(graphdef, params, batch, always_read):
  """[n_mem, K, ...row]: the zero deltas through which the memory layers read the bank on `batch` (one
  micro-batch); K = the row ids a layer's reads name (its decisions' chapters, or its lookups' slots), plus the
  `always_read` rows (the shared chapters), at most the bank's rows."""
  aux = jax.eval_shape(lambda p, b: lm_loss(nnx.merge(graphdef, p), b, train=True)[1][1], params, batch)
  named = aux["chapters"] if "chapters" in aux else aux["slots"]
  table = params["bank"]["memory"]
  k = min(table.shape[1], math.prod(named.shape[1:]) + always_read)
  return (named.shape[0], k) + tuple(table.shape[2:])


def make_train_step(graphdef, tx, config, idf=None):
  """`idf` [banks, chapters]: the background of `bank_optimizer=smf` (bank_background.idf)."""
  accum, bank, frozen = config.train.grad_accum, bank_update(config.train), frozen_groups(config.train)
  if bank.smf and idf is None:
    raise ValueError("bank_optimizer=smf needs the background's idf")
  mem = config.memory

  def step_stats(aux, batch):
    stats = {"aux": aux["router_loss"]}
    if "load" in aux:  # chapter reads: a router's choice, or cluster routing's paths
      stats["router_load"] = aux["load"] * accum  # summed over the update's micro-batches below
      if bank.smf:
        read = read_weight(aux["chapters"], aux.get("weights"), mem.num_chapters,
                           _decision_mask(aux["chapters"], batch))
        stats["router_read"] = read * accum
    if "entropy" in aux:
      stats["router_entropy"] = jnp.mean(aux["entropy"])
      stats.update({f"router_{k}": aux[k] for k in STEP_STATS if k in aux})
    return stats

  def loss_fn(params, batch):
    params = _stop_frozen(params, frozen)
    loss, (ce, aux) = lm_loss(nnx.merge(graphdef, params), batch, train=True)
    stats = {"ce": ce, **step_stats(aux, batch)}
    if "slots" in aux and bank.lazy:  # a dense gradient (a sharded table): the masked update needs the slots read
      stats["slots_read"] = _slots_read(aux["slots"], bank_ids(config), params["bank"]["memory"].shape[1]) * accum
    return loss, stats

  def sparse_loss_fn(rest, deltas, bank, batch):
    """The loss with the bank read through `deltas` -> (loss, (stats, the rows' chapter ids))."""
    params = _stop_frozen(nnx.merge_state(rest, bank), frozen)
    loss, (ce, aux) = lm_loss(nnx.merge(graphdef, params), batch, train=True, bank_deltas=deltas)
    return loss, ({"ce": ce, **step_stats(aux, batch)}, aux["rows"])

  def dense_grads(params, micro):
    """Loss, stats and gradient, each the mean over the micro-batches."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(acc, mb):
      return jax.tree.map(jnp.add, acc, grad_fn(params, mb)), None

    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro)))
    ((loss, stats), grads), _ = jax.lax.scan(body, zero, micro)
    return jax.tree.map(lambda x: x / accum, (loss, stats, grads))

  def sparse_grads(params, micro):
    """As dense_grads, with the bank's gradient as `SparseRows` per bank: no bank-sized array is built."""
    bank, rest = split_bank(params)
    first = jax.tree.map(lambda x: x[0], micro)
    table = params["bank"]["memory"]
    deltas = jnp.zeros(bank_delta_shape(graphdef, params, first, bank_shape(config).always_read), table.dtype)
    grad_fn = jax.value_and_grad(sparse_loss_fn, argnums=(0, 1), has_aux=True)

    def body(acc, mb):
      (loss, (stats, rows)), (g_rest, g_deltas) = grad_fn(rest, deltas, bank, mb)
      return jax.tree.map(jnp.add, acc, (loss, stats, g_rest)), (rows, g_deltas)

    out = jax.eval_shape(grad_fn, rest, deltas, bank, first)
    zero = jax.tree.map(jnp.zeros_like, (out[0][0], out[0][1][0], out[1][0]))
    (loss, stats, g_rest), (rows, g_deltas) = jax.lax.scan(body, zero, micro)
    loss, stats, g_rest = jax.tree.map(lambda x: x / accum, (loss, stats, g_rest))
    return loss, stats, (g_rest, _rows_per_bank(rows, g_deltas / accum, bank_ids(config), table.shape[1]))

  def train_step(state, batch):
    params = state["params"]
    micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)
    if bank.lazy:
      if _sparse_bank(bank, config):
        loss, stats, (rest_grads, bank_grad) = sparse_grads(params, micro)
      else:
        loss, stats, grads = dense_grads(params, micro)
        rest_grads, bank_grad = without_bank(grads), grads["bank"]["memory"][...]
      grad_norm = tx.global_norm(rest_grads, bank_grad)
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      mask = _row_mask(config, bank, params, stats, idf, state["step"])
      stats.pop("slots_read", None)  # bank-sized: not a metric
      new_params, opt_state = tx.apply(params, state["opt_state"], rest_grads, bank_grad, mask, grad_norm, ok)
      new = {"params": new_params, "opt_state": opt_state}
    else:
      loss, stats, grads = dense_grads(params, micro)
      grad_norm = optax.global_norm(grads)
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
      old = {"params": params, "opt_state": state["opt_state"]}
      new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    if mem.enabled and mem.load_balance == "aux_free" and "router_load" in stats:
      new["params"] = _move_balance_bias(graphdef, new["params"], stats["router_load"], mem, ok)
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
