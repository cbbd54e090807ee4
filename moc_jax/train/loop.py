"""The training loop: build or resume the state, step, log, evaluate, checkpoint; survive preemption.

Resume is exact: the newest finished checkpoint holds params, optimizer, step, data-iterator state and
rng, and metrics rows logged after it are dropped, so a run killed at any moment and re-run writes the
same losses as one that never stopped (same config and seed, CPU).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from moc_jax import checkpoint as ckpt_lib
from moc_jax import data as data_lib
from moc_jax import bank_background, flops, optim, sharding, upscale
from moc_jax.config import bank_ids, base_config, memory_layers, routing_statement
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax.errors import CheckpointError, ConfigError, CorruptCheckpointError, TrainingError
from moc_jax.model.build import count_params, warn_if_not_causal
from moc_jax.state import build_state, micro_batch_config
from moc_jax.train import cooldown, peaks
from moc_jax.train.metrics import MetricsWriter, RouterWindow
from moc_jax.train.step import jit_train_step
from moc_jax.train.workdir_lock import workdir_lock

log = logging.getLogger("moc_jax")


class _Preemption:
  """SIGTERM (pre-emption) or Ctrl-C (SIGINT) sets a flag; the loop saves a checkpoint at the next step
  boundary and exits cleanly, so neither loses the steps since the last checkpoint. A second Ctrl-C aborts at
  once (KeyboardInterrupt), as Python's own handler would.

  Multi-process, the save is collective, so every process must stop at the same step whichever got the
  signal: JAX's preemption service (started by jax.distributed.initialize; it catches SIGTERM itself, so no
  Python handler here) agrees on that step.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested, self.name = False, "SIGTERM"
    self._multihost = jax.process_count() > 1
    self._previous = {} if self._multihost else {s: signal.signal(s, self._handle) for s in self.SIGNALS}

  def _handle(self, signum, frame):
    if signum == signal.SIGINT and self.requested:
      raise KeyboardInterrupt
    self.requested, self.name = True, signal.Signals(signum).name

  def check(self, step) -> bool:
    """Whether to save and stop after `step`; call it at every step (the agreement protocol needs each)."""
    if self._multihost:
      self.requested = multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)


def train_and_evaluate(config, workdir: str, make_evaluator) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints); returns the last metrics.

  `make_evaluator(config, graphdef, param_shardings, batch_sharding)` returns the `params -> metrics`
  evaluation run at step 0 (fresh runs), every `train.eval_every` steps and at the end
  (moc_jax.eval.validation.ValidationEvaluator is the standard one)."""
  os.makedirs(workdir, exist_ok=True)
  warn_if_not_causal(config)
  mesh = sharding.make_mesh(config)
  lock = workdir_lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  with lock, sharding.activate(mesh, sharding.rules_of(config)):
    return _train(config, workdir, mesh, make_evaluator)


def _smf_idf(config):
  """The background idf of `bank_optimizer=smf` (read before anything compiles), else None."""
  bank = optim.bank_update(config.train)
  if not bank.smf:
    return None
  path = bank_background.path_for(config.train)
  idf = bank_background.idf(path, max(bank_ids(config)) + 1, config.memory.num_chapters)
  log.warning("moc_jax: sparse memory finetuning: %d chapters per bank per update, ranked against %s",
              bank.top_t, path)
  return idf


def _train(config, workdir, mesh, make_evaluator):
  t = config.train
  model_tokenizer(config)  # ids past the embedding are refused before anything is built
  idf = _smf_idf(config)
  fresh = not ckpt_lib.saved_steps(os.path.join(workdir, "checkpoints"))
  base = upscale.base_run(config) if t.upscale_from and fresh else None  # a resumed run no longer reads its base
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
  if checkpointer.all_steps():
    _check_same_optimizer(config, workdir)
  start, restored = _resume(checkpointer, abstract_state, data_iter)
  if restored is not None:
    state = {**restored, "nonfinite": jax.device_put(jnp.zeros((), jnp.int32), shardings["nonfinite"])}
    log.warning("moc_jax: resumed %s from step %d", workdir, start)
  else:
    start = 0
    state = init_fn()
    if t.init_from:
      params, from_step = ckpt_lib.restore_params(t.init_from, abstract_state["params"], padding=layout.padding)
      state["params"] = params
      log.warning("moc_jax: weights from %s (step %d); fresh optimizer and step", t.init_from, from_step)
    if base is not None:
      state["params"], from_step = upscale.upscaled_params(config, *base, mesh, state["params"], shardings["params"])
      log.warning("moc_jax: up-scaled %s (step %d): %s memory at layers %s%s", base[1], from_step,
                  config.memory.kind, memory_layers(config), "; the backbone frozen" if t.freeze_base else "")
  _write_config(config, workdir)  # only now: a refused resume leaves the run's config.json as it was
  _log_memory(config, abstract_state)
  throughput = Throughput(config)
  writer = MetricsWriter(workdir, t.steps, start, t.progress) if jax.process_index() == 0 else _NoMetrics()
  batch_sharding = sharding.data_sharding(config, mesh)
  train_step = jit_train_step(graphdef, tx, config, shardings, batch_sharding, idf)
  evaluator = make_evaluator(config, graphdef, shardings["params"], batch_sharding)
  branches = cooldown.Branches(config, layout, batch_sharding, idf, checkpointer, data_iter, evaluator, writer)
  preempt = _Preemption()
  missed = branches.missed(start)
  if missed:
    log.warning("moc_jax: train.cooldowns: the run resumed at step %d, past the start of the cool-downs from steps %s, "
                "which have no result: they are not trained (in a new --workdir they would be)", start, missed)
  if start == 0:  # the untrained baseline anchors the curves
    writer.write({"step": 0, "split": "validation", **evaluator(state["params"])})
  window = {"t0": time.time(), "wait": 0.0, "steps": 0, "malformed": 0}

  def next_batch(count=True):  # a cool-down's batches are read again by the run after it: not counted twice
    host_batch = next(data_iter)
    malformed = int(np.sum(host_batch.pop("n_malformed", 0)))
    window["malformed"] += malformed if count else 0
    return {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in host_batch.items()}
  router = RouterWindow(config)
  last, pending = {}, None

  def cool_down(step, saved):
    """The cool-down off `step`, if one is due (moc_jax/train/cooldown.py): (the state to go on from, whether to
    stop). A signal stops a branch at once in one process; with several, `requested` changes only at the run's own
    steps' agreed points (_Preemption.check), so the branch ends first and the run stops at its next step."""
    if step not in branches.ends:  # most steps: the throughput window goes on
      return state, False
    out = branches.off(step, state, lambda: next_batch(count=False), saved, lambda: preempt.requested)
    window.update(t0=time.time(), wait=0.0, steps=0)  # the branch's time is no training time of the run
    return out
  try:
    # a run stopped during the cool-down off the step it resumes at trains it now
    state, stop = cool_down(start, saved=True) if start else (state, False)
    if stop:
      _stopped(preempt, checkpointer, start)
    for step in range(start + 1, (start if stop else t.steps) + 1):
      t_wait = time.time()
      batch = next_batch()
      window["wait"] += time.time() - t_wait
      state, metrics = train_step(state, batch)
      window["steps"] += 1
      router.add(metrics)
      if pending is not None:  # read the previous step's counter: no host sync on the step just dispatched
        _check_nonfinite(*pending, t.max_nonfinite)
      pending = (step, metrics["nonfinite"])
      if step % t.log_every == 0 or step == t.steps:
        last = _log_row(writer, step, state, metrics, window, throughput, t, router)
      if step % t.eval_every == 0 or step == t.steps:
        writer.write({"step": step, "split": "validation", **evaluator(state["params"])})
        writer.plot()
        window.update(t0=time.time(), wait=0.0, steps=0)  # throughput counts training time only
      stop = preempt.check(step)  # read once: a signal arriving after the save must not skip it
      if step % t.checkpoint_every == 0 or step == t.steps or stop:
        checkpointer.save(step, state, data_iter)
        window.update(t0=time.time(), wait=0.0, steps=0)
      if not stop:
        state, stop = cool_down(step, saved=step % t.checkpoint_every == 0)
      if stop:
        _stopped(preempt, checkpointer, step)
        break
    if pending is not None:
      _check_nonfinite(*pending, t.max_nonfinite)
  finally:
    preempt.restore()
    checkpointer.close()
    writer.close()
  return last


def _stopped(preempt, checkpointer, step):
  checkpointer.wait()
  log.warning("moc_jax: %s — checkpoint saved at step %d; re-run the same command to resume", preempt.name, step)


def _resume(checkpointer, abstract_state, data_iter):
  """(step, restored state) of the newest checkpoint that restores, or (None, None) for a fresh run. A corrupt
  step is set aside with one warning and the one before it tried. A workdir whose every step was set aside is
  refused rather than restarted from step 0 (which would drop its metrics.jsonl rows)."""
  for step in reversed(checkpointer.all_steps()):
    try:
      return step, checkpointer.restore(step, abstract_state, data_iter)
    except CorruptCheckpointError as e:
      log.warning("moc_jax: %s — set aside as %s; trying the step before it", e, checkpointer.set_aside(step))
  aside = ckpt_lib.set_aside_steps(checkpointer.directory)
  if aside:
    raise CheckpointError(f"no checkpoint under {checkpointer.directory} restores (set aside as corrupt: "
                          f"{', '.join(aside)}); train in a new --workdir, or move them out of that directory to "
                          "start this run again from step 0")
  return None, None


def _bank_state_kind(train) -> tuple[str, str]:
  """(the layout of the bank's optimizer state, the setting that gives it) for a config's `train` as a dict; a
  field it lacks (a run saved before the field existed) takes its default."""
  bank = optim.bank_update({**base_config().train.to_dict(), **train})
  return bank.state_layout, bank.setting


def _check_same_optimizer(config, workdir):
  """A run resumes with a bank optimizer whose state has the layout it was trained with
  (`optim.BankUpdate.state_layout`): another is refused by name before Orbax compares arrays."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = _bank_state_kind(json.load(f).get("train", {}))
  wanted = _bank_state_kind(config.train.to_dict())
  if saved[0] != wanted[0]:
    raise ConfigError(f"config.train.bank_optimizer: {workdir} was trained with train.{saved[1]} and this config has "
                      f"train.{wanted[1]}, whose optimizer state differs; resume with --config.train.{saved[1]}, "
                      f"or start a new --workdir with --config.train.init_from={workdir} (its weights, a fresh optimizer)")


def _write_config(config, workdir):
  if jax.process_index() == 0:  # process 0 alone writes the workdir's files (metrics too: see _train)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))


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
  counts = count_params(config)
  msg = (f"moc_jax: {counts['total']:,} parameters (bank {counts['bank']:,}); params "
         f"{_nbytes(abstract_state['params']) / 2**20:.1f} MiB, optimizer state "
         f"{_nbytes(abstract_state['opt_state']) / 2**20:.1f} MiB")
  if optim.bank_update(config.train).frozen:
    msg += f" (freeze_bank: no Adam state for the bank, {2 * 4 * counts['bank'] / 2**20:.1f} MiB saved)"
  log.warning(msg)


class Throughput:
  """Tokens/s and MFU: model FLOPs from the analytic estimator (memory counted only as read, no
  recompute) over time x devices x the device's peak for the compute dtype (measured once on CPU)."""

  def __init__(self, config):
    self.tokens_per_step = config.train.batch_size * config.train.grad_accum * config.data.seq_len
    self.flops_per_step = flops.model_flops_per_token(config) * self.tokens_per_step
    self.devices = jax.device_count()
    self.peak, source = peaks.device_peak_flops(config.model.compute_dtype)
    log.warning("moc_jax: %.3g model FLOPs per step; peak %s FLOP/s per device (%s)", self.flops_per_step,
                f"{self.peak:.3g}" if self.peak else "unknown", source)

  def row(self, steps, seconds) -> dict:
    seconds = max(seconds, 1e-9)
    per_device = self.flops_per_step * steps / seconds / self.devices
    out = {"tokens_per_s": self.tokens_per_step * steps / seconds, "model_tflops_per_device": per_device / 1e12}
    if self.peak:
      out["mfu"] = per_device / self.peak
    return out


def _log_row(writer, step, state, metrics, window, throughput, t, router):
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
  writer.write({**row, **router.row(step, metrics)})
  window.update(t0=time.time(), wait=0.0, steps=0, malformed=0)
  return row
