"""The train state before it exists and as it is restored: its layout on a mesh (abstract shapes, shardings,
a jitted initialiser), the per-process data config, and parameters restored from a run's checkpoints.

Training, evaluation, generation, compile reports and benchmarks all build the state here, so a checkpoint
written by one restores in every other, on any mesh.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax import checkpoint as ckpt_lib
from moc_jax import optim, sharding
from moc_jax.config import bank_shape
from moc_jax.errors import CorruptCheckpointError
from moc_jax.model import Transformer
from moc_jax.model.build import abstract_model


def micro_batch_config(config):
  """Per-process data config: one loader batch = grad_accum micro-batches of this process's share."""
  d = config.data.copy_and_resolve_references()
  d.unlock()
  d.batch_size = config.train.batch_size * config.train.grad_accum // jax.process_count()
  return d


def eval_data_config(config):
  """Data config of evaluation batches: global (every process reads the same rows and hands each of its
  devices that device's share)."""
  d = micro_batch_config(config)
  d.batch_size = config.train.batch_size * config.train.grad_accum
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
  abstract = abstract_model(config)
  graphdef, abstract_params = nnx.split(abstract, nnx.Param)
  tx = optim.make_optimizer(config.train, abstract_params)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  rules = sharding.rules_of(config)
  p_shard = sharding.logical_shardings(abstract_params, mesh, rules)
  o_shard = sharding.logical_shardings(abstract_opt, mesh, rules)
  kind = optim.bank_update(config.train).state_memory
  if kind is not None:  # the lazy bank state off the device (optim.LazyBankOptimizer)
    o_shard = o_shard._replace(bank=jax.tree.map(lambda s: s.with_memory_kind(kind), o_shard.bank))
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  scalars = ("step", "nonfinite", "skipped", "rng")
  shardings = {"params": p_shard, "opt_state": o_shard, **{k: replicated for k in scalars}}
  bank = bank_shape(config)
  padding = sharding.ChapterPadding(bank.rows, sharding.padded_chapters(config, bank, dict(mesh.shape)))

  def init(seed):
    params = nnx.state(Transformer(config, nnx.Rngs(params=seed)), nnx.Param)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
            "nonfinite": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed))}

  init_fn = jax.jit(lambda: init(config.seed), out_shardings=shardings)
  abstract_state = jax.eval_shape(lambda: init(config.seed))
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract_state, shardings)
  return StateLayout(graphdef, tx, abstract_state, shardings, init_fn, padding)


def restore_params(workdir, layout, step=None):
  """(params, step): parameters only, restored onto `layout`'s abstract sharded params (this mesh), from the
  newest checkpoint or `step`. A corrupt step is named with the steps that do restore; nothing is renamed here
  (evaluation and generation only read a run, which may be training at the same time: setting a step aside is
  the training run's job, under its workdir lock)."""
  directory = ckpt_lib.checkpoint_dir(workdir)
  try:
    return ckpt_lib.restore_params(workdir, layout.abstract["params"], step=step, padding=layout.padding)
  except CorruptCheckpointError as e:
    bad = step if step is not None else ckpt_lib.saved_steps(directory)[-1]
    good = [s for s in ckpt_lib.saved_steps(directory) if s != bad and _params_restore(workdir, layout, s)]
    fix = f"pass --step={good[-1]}" if good else "no other step restores"
    raise CorruptCheckpointError(f"{e}; step {bad} is corrupt, steps that restore: {good} ({fix})") from None


def _params_restore(workdir, layout, step) -> bool:
  try:
    ckpt_lib.restore_params(workdir, layout.abstract["params"], step=step, padding=layout.padding)
  except CorruptCheckpointError:
    return False
  return True
