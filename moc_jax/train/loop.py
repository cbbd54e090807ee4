"""The training loop: build or resume the state, step, log, evaluate, checkpoint; survive preemption.

Resume is exact: the newest finished checkpoint holds params, optimizer, step, data-iterator state and
rng, and metrics rows logged after it are dropped, so a run killed at any moment and re-run writes the
same losses as one that never stopped (same config and seed, CPU).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import moc_jax
from moc_jax import checkpoint as ckpt_lib
from moc_jax import data as data_lib
from moc_jax import sharding
from moc_jax.config import routing_statement
from moc_jax.train import optim
from moc_jax.train.metrics import MetricsWriter
from moc_jax.train.step import make_eval_step, make_train_step

log = logging.getLogger("moc_jax")


class TrainingError(RuntimeError):
  """The run cannot continue (e.g. too many consecutive non-finite updates); nothing bad was saved."""


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits cleanly.

  Multi-process, the save is collective, so every process must stop at the same step whichever got the
  signal: JAX's preemption service (started by jax.distributed.initialize; it catches SIGTERM itself, so no
  Python handler here) agrees on that step.
  """

  def __init__(self):
    self.requested = False
    self._multihost = jax.process_count() > 1
    self._previous = None if self._multihost else signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.requested = True

  def check(self, step) -> bool:
    """Whether to save and stop after `step`; call it at every step (the agreement protocol needs each)."""
    if self._multihost:
      self.requested = multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def micro_batch_config(config):
  """Per-process data config: one loader batch = grad_accum micro-batches of this process's share."""
  d = config.data.copy_and_resolve_references()
  d.unlock()
  d.batch_size = config.train.batch_size * config.train.grad_accum // jax.process_count()
  return d


class StateLayout(NamedTuple):
  """Everything known about the train state before it exists: built by `build_state`."""
  graphdef: object
  tx: object
  abstract: dict       # ShapeDtypeStructs with their shardings
  shardings: dict
  init: object         # jitted () -> state, born sharded
  padding: sharding.ChapterPadding


def build_state(config, mesh) -> StateLayout:
  """The train state's layout on `mesh`; nothing allocated yet."""
  abstract = moc_jax.abstract_model(config)
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  tx = optim.make_optimizer(config.train, abstract_params)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  rules = sharding.rules_of(config)
  p_shard = sharding.logical_shardings(abstract_params, mesh, rules)
  o_shard = sharding.logical_shardings(abstract_opt, mesh, rules)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  scalars = ("step", "nonfinite", "skipped", "rng")
  shardings = {"params": p_shard, "opt_state": o_shard, **{k: replicated for k in scalars}}
  padding = sharding.ChapterPadding(config.memory.num_chapters, sharding.padded_chapters(config, dict(mesh.shape)))

  def init(seed):
    params = nnx.state(moc_jax.model.Transformer(config, nnx.Rngs(params=seed)), nnx.Param)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
            "nonfinite": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed))}

  init_fn = jax.jit(lambda: init(config.seed), out_shardings=shardings)
  abstract_state = jax.eval_shape(lambda: init(config.seed))
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract_state, shardings)
  return StateLayout(graphdef, tx, abstract_state, shardings, init_fn, padding)


def jit_train_step(graphdef, tx, config, shardings, batch_sharding):
  """The one jitted train step: explicit state/batch shardings, the state donated."""
  return jax.jit(make_train_step(graphdef, tx, config), in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, None), donate_argnums=0)


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints); returns the last metrics."""
  os.makedirs(workdir, exist_ok=True)
  moc_jax._warn_if_not_causal(config)
  if jax.process_index() == 0:  # process 0 alone writes the workdir's files (metrics too: see _train)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    return _train(config, workdir, mesh)


def _train(config, workdir, mesh):
  t = config.train
  layout = build_state(config, mesh)
  graphdef, tx, abstract_state, shardings, init_fn = layout[:5]
  log.warning("moc_jax: mesh %s over %d devices (%d processes)%s", dict(mesh.shape), mesh.size, jax.process_count(),
              f"; bank chapters padded {layout.padding.real} -> {layout.padding.padded}" if layout.padding.active else "")
  log.warning("moc_jax: %s", routing_statement(config))
  data_cfg = micro_batch_config(config)
  data_iter = data_lib.make_train_iterator(data_cfg, process_index=jax.process_index(),
                                           process_count=jax.process_count())
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                                       padding=layout.padding)
  start = checkpointer.latest_step()
  if start is not None:
    state = {**checkpointer.restore(start, abstract_state, data_iter),
             "nonfinite": jax.device_put(jnp.zeros((), jnp.int32), shardings["nonfinite"])}
    log.warning("moc_jax: resumed %s from step %d", workdir, start)
  else:
    start = 0
    state = init_fn()
    if t.init_from:
      params, from_step = ckpt_lib.restore_params(t.init_from, abstract_state["params"], padding=layout.padding)
      state["params"] = params
      log.warning("moc_jax: weights from %s (step %d); fresh optimizer and step", t.init_from, from_step)
  _log_memory(config, abstract_state)
  throughput = Throughput(config)
  writer = MetricsWriter(workdir, t.steps, start, t.progress) if jax.process_index() == 0 else _NoMetrics()
  batch_sharding = sharding.data_sharding(config, mesh)
  train_step = jit_train_step(graphdef, tx, config, shardings, batch_sharding)
  evaluator = Evaluator(config, graphdef, shardings["params"], batch_sharding)
  preempt = _Preemption()
  if start == 0:  # the untrained baseline anchors the curves
    writer.write({"step": 0, "split": "validation", **evaluator(state["params"])})
  window = {"t0": time.time(), "wait": 0.0, "steps": 0, "malformed": 0}
  last, pending = {}, None
  try:
    for step in range(start + 1, t.steps + 1):
      t_wait = time.time()
      host_batch = next(data_iter)
      window["wait"] += time.time() - t_wait
      window["malformed"] += int(np.sum(host_batch.pop("n_malformed", 0)))
      batch = {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in host_batch.items()}
      state, metrics = train_step(state, batch)
      window["steps"] += 1
      if pending is not None:  # read the previous step's counter: no host sync on the step just dispatched
        _check_nonfinite(*pending, t.max_nonfinite)
      pending = (step, metrics["nonfinite"])
      if step % t.log_every == 0 or step == t.steps:
        last = _log_row(writer, step, state, metrics, window, throughput, t)
      if step % t.eval_every == 0 or step == t.steps:
        writer.write({"step": step, "split": "validation", **evaluator(state["params"])})
        writer.plot()
        window.update(t0=time.time(), wait=0.0, steps=0)  # throughput counts training time only
      stop = preempt.check(step)  # read once: a signal arriving after the save must not skip it
      if step % t.checkpoint_every == 0 or step == t.steps or stop:
        checkpointer.save(step, state, data_iter)
        window.update(t0=time.time(), wait=0.0, steps=0)
      if stop:
        checkpointer.wait()
        log.warning("moc_jax: SIGTERM — checkpoint saved at step %d; re-run the same command to resume", step)
        break
    if pending is not None:
      _check_nonfinite(*pending, t.max_nonfinite)
  finally:
    preempt.restore()
    checkpointer.close()
    writer.close()
  return last


class _NoMetrics:
  """Processes other than 0 of a multi-host run: process 0 alone writes metrics.jsonl, TensorBoard, loss.png."""

  def write(self, row):
    pass

  def plot(self):
    pass

  def close(self):
    pass


def _check_nonfinite(step, consecutive, limit):
  if int(consecutive) >= limit:
    raise TrainingError(f"{limit} consecutive non-finite updates at step {step} (all skipped, nothing saved "
                        "after them); lower train.base_lr/memory_lr or check the data")


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _log_memory(config, abstract_state):
  counts = moc_jax.count_params(config)
  msg = (f"moc_jax: {counts['total']:,} parameters (bank {counts['bank']:,}); params "
         f"{_nbytes(abstract_state['params']) / 2**20:.1f} MiB, optimizer state "
         f"{_nbytes(abstract_state['opt_state']) / 2**20:.1f} MiB")
  if config.train.freeze_bank:
    msg += f" (freeze_bank: no Adam state for the bank, {2 * 4 * counts['bank'] / 2**20:.1f} MiB saved)"
  log.warning(msg)


class Throughput:
  """Tokens/s and MFU: model FLOPs from the analytic estimator (memory counted only as read, no
  recompute) over time x devices x the device's peak for the compute dtype (measured once on CPU)."""

  def __init__(self, config):
    from moc_jax import flops
    from moc_jax.bench.peaks import device_peak_flops
    self.tokens_per_step = config.train.batch_size * config.train.grad_accum * config.data.seq_len
    self.flops_per_step = flops.model_flops_per_token(config) * self.tokens_per_step
    self.devices = jax.device_count()
    self.peak, source = device_peak_flops(config.model.compute_dtype)
    log.warning("moc_jax: %.3g model FLOPs per step; peak %s FLOP/s per device (%s)", self.flops_per_step,
                f"{self.peak:.3g}" if self.peak else "unknown", source)

  def row(self, steps, seconds) -> dict:
    seconds = max(seconds, 1e-9)
    per_device = self.flops_per_step * steps / seconds / self.devices
    out = {"tokens_per_s": self.tokens_per_step * steps / seconds, "model_tflops_per_device": per_device / 1e12}
    if self.peak:
      out["mfu"] = per_device / self.peak
    return out


def _log_row(writer, step, state, metrics, window, throughput, t):
  metrics = jax.device_get(metrics)
  elapsed = time.time() - window["t0"]
  lrs = optim.current_lrs(t, step - 1 - int(state["skipped"]))
  row = {"step": step, "loss": metrics["loss"], "ce": metrics["ce"], "aux": metrics["aux"],
         "lr": lrs["base"], "lr_memory": lrs["memory"], "lr_bank": lrs["bank"], "grad_norm": metrics["grad_norm"],
         **throughput.row(window["steps"], elapsed),
         "data_wait_frac": window["wait"] / max(elapsed, 1e-9), "skipped_nonfinite": int(state["skipped"]),
         "malformed_records": window["malformed"]}
  if "router_entropy" in metrics:
    row["router_entropy"] = metrics["router_entropy"]
  writer.write(row)
  window.update(t0=time.time(), wait=0.0, steps=0, malformed=0)
  return row


class Evaluator:
  """Validation CE over the eval split (and fact recall on moc_facts probes)."""

  def __init__(self, config, graphdef, p_shard, batch_sharding):
    d = micro_batch_config(config)
    d.batch_size = config.train.batch_size * config.train.grad_accum  # global: all processes read the same rows
    self.batches = list(data_lib.make_eval_batches(d, split="validation", max_batches=config.train.eval_batches))
    self.sharding = batch_sharding
    self.step = jax.jit(make_eval_step(graphdef), in_shardings=(p_shard, batch_sharding))
    self.probes = None
    if config.data.name == "moc_facts":
      from moc_jax.data.tokenizers import get_tokenizer
      from moc_jax.eval import ProbeEvaluator, select_probes
      probes = select_probes(data_lib.load_probes(config.data), config.train.num_probes, config.seed)
      self.probes = ProbeEvaluator(graphdef, probes, get_tokenizer(config.data.tokenizer))

  def __call__(self, params) -> dict:
    nll, count = 0.0, 0
    for b in self.batches:
      b = {k: v for k, v in b.items() if k != "n_malformed"}
      # every process holds the whole global batch and hands each of its devices that device's rows
      s, c = self.step(params, {k: jax.make_array_from_callback(v.shape, self.sharding, lambda i, v=v: v[i])
                                for k, v in b.items()})
      nll, count = nll + float(s), count + int(c)
    ce = nll / max(count, 1)
    out = {"ce": ce, "ppl": float(np.exp(min(ce, 50.0))), "tokens": count}
    if self.probes is not None:
      out.update(self.probes(params))
    return out


def evaluate_checkpoint(config, workdir: str, options=None) -> dict:
  """--mode=eval: `moc_jax.eval.evaluate` of the newest checkpoint in `workdir` (CE on the validation
  split, fact recall, routing analysis; eval.json written), restored onto this run's mesh whatever mesh
  saved it."""
  from moc_jax.eval import evaluate
  return evaluate(config, workdir, options)
