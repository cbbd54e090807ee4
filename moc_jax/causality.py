"""`python -m moc_jax.causality --config=configs/moc.py:tiny [--config.memory.routing=prefix]`: does
anything at positions <= t depend on tokens after t?

`probe(config)` builds the model at float32 with every zero-initialised weight re-drawn (at init the
memory output projection is zero and would hide the memory read), feeds random rows, replaces the
tokens after t with other random tokens and reports the largest change of the logits at positions
<= t, for several t. Exactly zero means no path from the future: the backbone is causal, so a
non-zero change comes from routing (`sequence` pools the whole row).
"""
from __future__ import annotations

import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import moc_jax
from moc_jax.config import routing_is_causal
from moc_jax import cli
from moc_jax.errors import UsageError


def _redraw_zeros(model, seed):
  """Every all-zero parameter (the memory W_o, biases) gets N(0, 0.02), so each path reaches the logits. Each draw
  is keyed by the parameter's path, so a module gaining an attribute elsewhere changes no draw."""
  key = jax.random.key(seed)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param) and not np.any(np.asarray(var[...])):
      where = zlib.crc32("/".join(map(str, path)).encode())
      var.set_value(0.02 * jax.random.normal(jax.random.fold_in(key, where), var[...].shape, var[...].dtype))


def probe(config, *, length=None, batch=2, seed=0, positions=None) -> dict:
  """{routing, causal_by_design, positions, max_change (per t), max_change_all, causal} for `config`."""
  config = config.copy_and_resolve_references()
  config.unlock()
  config.model.compute_dtype = "float32"
  length = length or min(config.model.max_seq_len, 64)
  model = moc_jax.build_model(config, seed=seed)
  _redraw_zeros(model, seed + 1)
  rng = np.random.default_rng(seed)
  vocab = config.model.vocab_size
  tokens = rng.integers(1, vocab, (batch, length))
  positions = positions or sorted({0, length // 3, length // 2 - 1, length - 2})
  forward = jax.jit(lambda ids: model(ids, jnp.ones_like(ids))[0])
  base = np.asarray(forward(jnp.asarray(tokens)))
  changes = {}
  for t in positions:
    other = tokens.copy()
    other[:, t + 1:] = (tokens[:, t + 1:] + rng.integers(1, vocab - 1, other[:, t + 1:].shape) - 1) % (vocab - 1) + 1
    changed = np.asarray(forward(jnp.asarray(other)))
    changes[t] = float(np.max(np.abs(changed[:, :t + 1] - base[:, :t + 1])))
  worst = max(changes.values())
  return {"routing": config.memory.routing if config.memory.enabled else "none",
          "causal_by_design": routing_is_causal(config), "length": length, "max_change": changes,
          "max_change_all": worst, "causal": worst == 0.0}


def main(argv):
  from absl import flags
  cli.quiet_libraries()
  if len(argv) > 1 or flags.FLAGS.config is None:
    raise UsageError("usage: python -m moc_jax.causality --config=PATH.py:ARG [--config.x=y]")
  result = probe(flags.FLAGS.config, length=flags.FLAGS.length)
  print(json.dumps(result))
  return 0 if result["causal"] == result["causal_by_design"] else 1


if __name__ == "__main__":
  from absl import flags
  cli.define_config_file_flag("Config file and argument, e.g. configs/moc.py:tiny.")
  flags.DEFINE_integer("length", None, "Sequence length probed (default min(max_seq_len, 64)).")
  cli.run(main)
