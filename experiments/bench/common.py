"""The harness every benchmark shares, so they all time the same thing: the production train step.

`Trainer` builds the state with `state.build_state` on a one-device mesh and jits
`train.step.jit_train_step`, the training loop's own jitted step (shardings, donated state), on a fixed
synthetic batch. Timings block on every call, drop warm-up calls, and report medians (robust to
background load; the 1-minute load average is recorded with every result).

FLOPs follow the MFU convention: the analytic model FLOPs of `moc_jax.flops` (forward + backward,
memory counted only for the chapters read), WITHOUT the forward recompute of `model.remat`, which
is overhead the hardware does but the model does not need.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

import moc_jax
from moc_jax import flops, optim, sharding
from moc_jax.config import bank_shape
from moc_jax.errors import ConfigError
from moc_jax.losses import lm_loss, next_token_ce
from moc_jax.state import build_state
from moc_jax.train import peaks
from moc_jax.train.peaks import cpu_model
from moc_jax.train.step import bank_delta_shape, jit_train_step


def environment() -> dict:
  d = jax.devices()[0]
  return {"device_kind": d.device_kind, "platform": d.platform, "devices": jax.device_count(),
          "jax": jax.__version__, "cores": os.cpu_count(), "cpu": cpu_model(),
          "load_avg_1m": round(os.getloadavg()[0], 2)}


def emit(result: dict) -> dict:
  """Prints the benchmark's one JSON line (with the environment) and returns it."""
  result = {**result, "environment": environment()}
  print(json.dumps(result))
  return result


def load(spec: str, batch_size: int | None = None, overrides: dict | None = None):
  """`moc_jax.load_config` with the micro-batch size (None keeps the config's) and dotted overrides."""
  overrides = dict(overrides or {})
  if batch_size is not None:
    overrides["train.batch_size"] = batch_size
  with contextlib.redirect_stdout(io.StringIO()) as note:  # configs/vanilla.py:iso=... prints its choice
    config = moc_jax.load_config(spec, overrides)
  return config, note.getvalue().strip()


def define_config_flags(flag_values, config: str, batch_size: int | None):
  """--config, --batch_size and --set: the flags of every benchmark of one config, defined in one place."""
  flags.DEFINE_string("config", config, "config spec, e.g. configs/moc.py:small", flag_values=flag_values)
  flags.DEFINE_integer("batch_size", batch_size, "sequences per micro-batch (train.batch_size)"
                       + ("" if batch_size else "; default: the config's"), flag_values=flag_values)
  define_set_flag(flag_values, "config override, e.g. --set model.remat=none")


def define_set_flag(flag_values, help_text: str):
  """--set KEY=VALUE, repeatable; `parse_overrides` turns its values into a config override dict."""
  flags.DEFINE_multi_string("set", [], help_text, flag_values=flag_values)


def define_int_list_flag(flag_values, name: str, default, help_text: str):
  """A comma-separated list of integers, e.g. --sizes=4096,16384: one that is not an integer is a flag error."""
  flags.DEFINE(_IntListParser(), name, list(default), help_text, flag_values=flag_values,
               serializer=flags.CsvListSerializer(","))


class _IntListParser(flags.ListParser):
  """absl's comma-separated list parser, with every item an int (a ValueError is absl's flag error)."""

  def __init__(self):
    super().__init__()
    self.syntactic_help = "a comma separated list of integers"

  def parse(self, argument):
    return [int(item) for item in super().parse(argument)]


def parse_overrides(pairs: list[str]) -> dict:
  """KEY=VALUE strings to a dict; values are Python literals where they parse, strings otherwise."""
  out = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep:
      raise ConfigError(f"--set {pair!r}: expected KEY=VALUE")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def summary(seconds: list[float]) -> dict:
  """Median (the reported statistic), mean, min and every sample, so background load stays visible."""
  return {"median_s": statistics.median(seconds), "mean_s": statistics.fmean(seconds), "min_s": min(seconds),
          "n": len(seconds), "all_s": [round(s, 4) for s in seconds]}


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 1) -> list[float]:
  """Seconds of each of `n` calls of `fn` after `warmup` untimed ones, blocking on the result."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times


def synthetic_batch(config, seed: int = 0) -> dict:
  """A global batch of uniform random tokens: [batch_size * grad_accum, seq_len] int32, no padding; with a cluster
  tree (data.cluster.k > 0) each row one random path down it, as the pipeline gives each document's tokens."""
  rows = config.train.batch_size * config.train.grad_accum
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, config.model.vocab_size, (rows, config.data.seq_len), np.int32)
  batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()}
  if config.data.cluster.k > 0:  # a leaf per row and its ancestors: level l's node index is in 0 ... k^(l+1) - 1
    k, levels = config.data.cluster.k, config.data.cluster.levels
    leaves = rng.integers(0, k ** levels, rows)
    paths = np.stack([leaves // k ** (levels - 1 - level) for level in range(levels)], -1).astype(np.int32)
    batch["cluster_path"] = np.repeat(paths[:, None], config.data.seq_len, axis=1)
  return batch


def tokens_per_step(config) -> int:
  return config.train.batch_size * config.train.grad_accum * config.data.seq_len


def analytic_train_flops_per_step(config) -> float:
  """Model FLOPs of one optimizer step: fwd + bwd per token (no recompute, no optimizer) x tokens."""
  return flops.model_flops_per_token(config) * tokens_per_step(config)


PEAK_SIZES = (1024, 2048)  # square matmul sizes of an in-process CPU peak


def device_peak(dtype, peak_sizes=PEAK_SIZES):
  """(peak FLOP/s of this process's device in `dtype`, where it came from): on a CPU measured here and now
  (`peaks.measure`), so a step timed right after sees the same machine state; else the table's."""
  if jax.devices()[0].platform == "cpu":
    return peaks.measure(dtype, sizes=peak_sizes)["flops_per_s"], "peaks.measure in this process"
  return peaks.device_peak_flops(dtype)


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float | None, devices: int = 1) -> float | None:
  return None if not peak_flops else flops_per_step / (step_seconds * devices * peak_flops)


def single_device_mesh(config):
  return sharding.make_mesh(config, jax.devices()[:1])


class Trainer:
  """The production train step of `config`, compiled on one device, with its state and a fixed batch."""

  def __init__(self, config, seed: int = 0):
    self.config = config
    mesh = single_device_mesh(config)
    self.graphdef, self.tx, _, shardings, init_fn, _ = build_state(config, mesh)
    batch_sharding = sharding.data_sharding(config, mesh)
    step = jit_train_step(self.graphdef, self.tx, config, shardings, batch_sharding)
    self.state = init_fn()
    self.batch = jax.device_put(synthetic_batch(config, seed), batch_sharding)
    t0 = time.perf_counter()
    self._step = step.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - t0
    self._update = self._loss = None
    self.flops_per_step = analytic_train_flops_per_step(config)

  def step(self):
    self.state, metrics = self._step(self.state, self.batch)
    return metrics

  def run(self, n: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `n` train steps (after `warmup` untimed ones)."""
    return time_calls(self.step, n, warmup)

  def forward(self):
    """The step's loss (forward only, same params and batch), compiled on first use."""
    if self._loss is None:
      graphdef = self.graphdef
      self._loss = jax.jit(lambda params, batch: lm_loss(nnx.merge(graphdef, params), batch, train=True)[0])
    return self._loss(self.state["params"], self.batch)

  def time_optimizer(self, n: int, warmup: int = 1) -> list[float]:
    """Seconds of the optimizer alone, on gradient-sized inputs, state donated as in the step: tx.update +
    apply_updates over every parameter (AdamW on the whole bank included); with `bank_optimizer=lazy_adam`,
    the bank's rows as the step reads them (the first K chapters of each bank, K as in the step)."""
    if self._update is None:
      self._update, self._grads = self._optimizer_update()

    def call():
      params, opt_state = self._update(self._grads, self.state["params"], self.state["opt_state"])
      self.state = {**self.state, "params": params, "opt_state": opt_state}
      return params
    return time_calls(call, n, warmup)


  def _optimizer_update(self):
    """(jitted (grads, params, opt_state) -> (params, opt_state), grads) of the step's update rule. The donated
    inputs come in the outputs' order: JAX pairs donated buffers with outputs of the same shape in order, and the
    bank and its two moments share one shape, so any other order makes XLA copy them around the update."""
    params = self.state["params"]
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    if not isinstance(self.tx, optim.LazyBankOptimizer):
      def update(grads, params, opt_state):
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
      return jax.jit(update, donate_argnums=(1, 2)), grads
    micro = jax.tree.map(lambda x: x[:self.config.train.batch_size], self.batch)
    _, k, *row = bank_delta_shape(self.graphdef, params, micro, bank_shape(self.config).always_read)
    banks, chapters = params["bank"]["memory"].shape[:2]
    ids = jnp.arange(k, dtype=jnp.int32)
    rows = [optim.SparseRows(ids, jnp.full((k, *row), 1e-3, jnp.float32)) for _ in range(banks)]
    read = jnp.zeros((banks, chapters), bool).at[:, :k].set(True)

    def update(grads, params, opt_state):
      rest, bank = grads
      norm = self.tx.global_norm(rest, bank)
      return self.tx.apply(params, opt_state, rest, bank, read, norm, jnp.isfinite(norm))
    return jax.jit(update, donate_argnums=(1, 2)), (optim.without_bank(grads), rows)


_TRAINERS: dict[str, Trainer] = {}


def trainer(config) -> Trainer:
  """The Trainer of `config`, built once per process: benchmarks run together (tests) share compiles."""
  key = config.to_json_best_effort(sort_keys=True)
  if key not in _TRAINERS:
    _TRAINERS[key] = Trainer(config)
  return _TRAINERS[key]


# ---- the model cut into the components the FLOPs estimator counts ----

@dataclasses.dataclass
class Component:
  """One sublayer as a pure `fn(state, h)`; its forward FLOPs by the estimator; how often a forward runs it."""
  name: str
  fn: Callable
  state: Any
  h: Any
  count: int
  analytic_forward: int


def components(config, *, abstract: bool) -> list[Component]:
  """Self-attention, MLP and memory sublayers and the LM head at the config's micro-batch shape.

  Their estimator FLOPs add up to the estimator's whole forward (the embedding lookup counts 0).
  `abstract`: states and inputs are ShapeDtypeStructs (lowering / cost analysis, nothing allocated);
  otherwise the model is initialised and `h` is random (timing).
  """
  c = config.copy_and_resolve_references()
  c.model.scan_layers = False  # one Python object per layer, so layers can be taken apart
  model = moc_jax.abstract_model(c) if abstract else moc_jax.build_model(c, seed=c.seed)
  b, l, d = c.train.batch_size, c.data.seq_len, c.model.d_model
  est = flops.estimate(c, b, l, recompute=False)
  std = est["standard_layer"]
  blocks = list(model.layers.blocks)
  h = jax.ShapeDtypeStruct((b, l, d), jnp.float32)
  if not abstract:
    h = jax.random.normal(jax.random.key(0), h.shape, h.dtype)
  positions = jnp.broadcast_to(jnp.arange(l), (b, l))
  mask = jnp.tril(jnp.ones((l, l), bool))[None, None]
  labels = jnp.asarray(synthetic_batch(c)["labels"][:b])
  plain = blocks[0]  # every block has the same self-attention and MLP

  def part(name, modules, fn, count, analytic):
    graphdef, state = nnx.split(modules)
    if abstract:
      state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return Component(name, lambda s, x: fn(nnx.merge(graphdef, s), x), state, h, count, analytic)

  parts = [
      part("self_attention", (plain.attn_norm, plain.attn), lambda m, x: x + m[1](m[0](x), positions, mask),
           c.model.num_layers,
           std["self_attention"]["total"] + std["rope"] + std["norms"]["attention"] + std["residuals"]["attention"]),
      part("mlp", (plain.mlp_norm, plain.mlp), lambda m, x: x + m[1](m[0](x)), c.model.num_layers,
           std["mlp"]["total"] + std["norms"]["mlp"] + std["residuals"]["mlp"]),
  ]
  if model.bank is not None:
    if c.memory.block_variant != "A":
      raise ValueError("components() models variant A memory layers only")
    mem_block = next(blk for blk in blocks if blk.memory is not None)
    mem = c.memory

    def memory(m, x):
      out, stats = m[0](x, x, m[1].memory[...][0])
      aux = mem.load_balance_coef * stats["load_balance"] + mem.z_loss_coef * stats["z_loss"] \
          + mem.mse_aux_coef * stats["mse_aux"]
      return x + out, aux, stats["entropy"]  # entropy too: the estimator counts it, XLA must not drop it
    parts.append(part("memory", (mem_block.memory, model.bank), memory, len(est["layers"]["memory"]),
                      est["memory_layer"]["memory"]["total"]))
  parts.append(part("head", (model.final_norm, model.embed),
                    lambda m, x: next_token_ce(m[1].attend(m[0](x)), labels), 1, est["head"]["total"]))
  return parts


def interleave(trainers: dict, rounds: int, steps_per_round: int, settle_s: float = 0.0) -> dict:
  """Alternates `steps_per_round` steps of each trainer for `rounds` rounds; seconds per trainer.

  Every trainer sees the same stretches of background load, so ratios of their medians are fair. `settle_s`:
  an untimed pause before each trainer's steps. The runtime still works for a while after a step's result is
  ready (on this 2-core CPU a lazy step that follows a dense step at a 4.2M-token bank takes 0.3 s longer than
  one that follows itself; a 1 s pause removes it); without the pause that work is charged to whichever
  trainer runs next.
  """
  times = {name: [] for name in trainers}
  for _ in range(rounds):
    for name, trainer in trainers.items():
      time.sleep(settle_s)
      times[name] += trainer.run(steps_per_round)
  return times


def forward_and_backward(fn):
  """fn(state, h) -> its outputs' VJP with all-ones cotangents: one forward plus one backward."""
  def fwd_bwd(state, h):
    out, vjp = jax.vjp(fn, state, h)
    return vjp(jax.tree.map(jnp.ones_like, out))
  return fwd_bwd
