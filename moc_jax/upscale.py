"""Depth up-scaling (MIDUS, "Memory-Infused Depth Up-Scaling"; Llama Pro, Wu et al. 2024): a run that starts from a
trained run's model with memory inserted (`train.upscale_from`), its outputs at step 0 the base model's.

The up-scaled model has the base's backbone and depth (config.validate_upscale) and memory at this config's memory
layers, so layer i of the base is layer i here, whatever groups the two stack under `lax.scan` (`LayerPlan.slot`).
What is inserted adds nothing until it trains: an hml block (a block of its own before layer i) reads a value table
that starts at zero; a chapter read's W_o and a pkm read's W2 (inside layer i) start at zero under
memory.wo_init_zero. An inserted hml block takes its norm and attention (q, k, v) from the block after it
(train.upscale_copy=next, MIDUS) or before it (previous, Llama Pro); the rest of the memory keeps its
initialisation. A base run with memory keeps it: its memory layers stay at their layers, its tables go to the
tables those layers read (`config.base_tables`).

With train.freeze_base the backbone (optimizer group `base`) is out of the optimizer (optim.frozen_groups): the
parameters a base without memory trained stay bit for bit, and the memory alone trains.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import jax
from flax import nnx, traverse_util

from moc_jax import checkpoint as ckpt_lib
from moc_jax import state as state_lib
from moc_jax.config import (
  base_tables,
  layer_plan,
  load_run_config,
  memory_layers,
  validate_upscale,
)
from moc_jax.errors import ConfigError


class Copy(NamedTuple):
  """One array of the up-scaled parameters taken from the base run's: `path`[`index`] <- the base's
  `source`[`source_index`], an index a position on a stacked axis (the scanned groups, the bank's tables), None the
  whole leaf."""
  path: tuple
  index: int | None
  source: tuple
  source_index: int | None


# what an inserted hml block takes from the block it copies: (its parameter, the block's)
ATTENTION = ((("norm", "scale"), ("attn_norm", "scale")),
             *((("attn", n, "kernel"), ("attn", n, "kernel")) for n in "qkv"))


def base_run(config):
  """(the config of train.upscale_from's run, laid out on this run's mesh; its workdir), checked against `config`:
  a ConfigError naming the field and the fix if it cannot be up-scaled to `config`. Reads only."""
  path = os.path.normpath(config.train.upscale_from)
  workdir = os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path  # a workdir or its checkpoints/
  fix = "pass the workdir of a trained run (it holds config.json and checkpoints/)"
  if not os.path.isdir(workdir):
    raise _bad_source(f"{config.train.upscale_from} does not exist", fix)
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise _bad_source(f"{workdir} holds no config.json", fix)
  if not ckpt_lib.saved_steps(os.path.join(workdir, "checkpoints")):
    raise _bad_source(f"{workdir} holds no checkpoint", "train the base run until it saves one, or pass another run")
  base = load_run_config(workdir)
  base.mesh, base.logical_axis_rules = config.mesh, config.logical_axis_rules  # restored onto this run's mesh
  validate_upscale(config, base)
  return base, workdir


def _bad_source(problem, fix):
  return ConfigError(f"config.train.upscale_from: {problem} — {fix}")


def copies(config, base, base_paths) -> list[Copy]:
  """Every array of `config`'s parameters that comes from the base run's (`base_paths`: the paths of its parameter
  leaves, as nnx.to_flat_state gives them): the embedding and final norm; layer i's block, on whichever stacked slot
  each plan puts layer i; the base's value or chapter tables; and the attention each inserted hml block copies."""
  plan, base_plan = layer_plan(config), layer_plan(base)
  out, blocks = [], {}
  for path in base_paths:
    if path[:2] == ("layers", "blocks"):
      blocks.setdefault(path[2], []).append(path[3:])
    elif path[0] != "bank":
      out.append(Copy(path, None, path, None))
  for i in range(config.model.num_layers):
    (j, g), (base_j, base_g) = plan.slot(i), base_plan.slot(i)
    out += [Copy(("layers", "blocks", j, *sub), g, ("layers", "blocks", base_j, *sub), base_g) for sub in blocks[base_j]]
  out += [Copy(("bank", "memory"), table, ("bank", "memory"), b) for table, b in base_tables(config, base)]
  if config.memory.kind == "hml":
    for i in sorted(set(memory_layers(config)) - set(memory_layers(base))):
      (j, g), (src_j, src_g) = plan.slot(i), base_plan.slot(i if config.train.upscale_copy == "next" else i - 1)
      out += [Copy(("layers", "blocks", j, "memory", *mine), g, ("layers", "blocks", src_j, *theirs), src_g)
              for mine, theirs in ATTENTION]
  return out


def upscaled_params(config, base, workdir, mesh, params, shardings):
  """(this run's initialised `params` (an nnx.State on `mesh`, laid out as `shardings`) with the arrays of `copies`
  from the newest checkpoint of the base run in `workdir`, that checkpoint's step). The base's parameters are
  restored onto the same mesh by the checkpoint code that restores any run's."""
  base_params, step = state_lib.restore_params(workdir, state_lib.build_state(base, mesh))
  moves = copies(config, base, [path for path, _ in nnx.to_flat_state(base_params)])

  def merge(params, base_params):
    flat = traverse_util.flatten_dict(params.to_pure_dict())
    source = traverse_util.flatten_dict(base_params.to_pure_dict())
    for c in moves:
      value = source[c.source] if c.source_index is None else source[c.source][c.source_index]
      flat[c.path] = flat[c.path].at[... if c.index is None else c.index].set(value)
    nnx.replace_by_pure_dict(params, traverse_util.unflatten_dict(flat))
    return params

  return jax.jit(merge, out_shardings=shardings, donate_argnums=0)(params, base_params), step
