"""Building the model from a config: initialised, abstract (shapes only), and its parameter counts and
optimizer groups."""
from __future__ import annotations

import logging

import numpy as np
from flax import nnx

from moc_jax.config import bank_shape, routing_is_causal, routing_statement, validate
from moc_jax.model.transformer import Transformer

log = logging.getLogger("moc_jax")


def warn_if_not_causal(config):
  if not routing_is_causal(config):
    log.warning("moc_jax: %s", routing_statement(config))


def build_model(config, seed: int = 0):
  """Validates `config` and returns an initialised `moc_jax.model.Transformer` (float32 params)."""
  validate(config)
  warn_if_not_causal(config)
  return Transformer(config, nnx.Rngs(params=seed))


def abstract_model(config):
  """The model with ShapeDtypeStruct leaves: no allocation (jax.eval_shape)."""
  validate(config)
  return nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(params=0)))


def param_groups(path) -> str:
  """'bank' | 'memory' | 'base' for a parameter path (MoC-PT's optimizer groups, docs/mocpt_semantics.md), or
  'fixed' for the aux-free balance bias (outside the optimizer: the train step moves it)."""
  names = [str(p) for p in path]
  if "balance_bias" in names:
    return "fixed"
  if "bank" in names:
    return "bank"
  if "memory" in names or "post_memory_norm" in names or "post_memory_mlp" in names:
    return "memory"
  return "base"


def count_params(config) -> dict:
  """Parameter counts {total, backbone, bank, memory_layers} from shapes alone (no allocation): `bank` is the
  chapter bank or the value table, `memory_layers` the rest of the memory (routers, memory attention; product keys,
  queries, gates, hml blocks). The aux-free balance bias is routing state, not a trained parameter, and is not
  counted."""
  counts = {"backbone": 0, "bank": 0, "memory_layers": 0}
  key = {"base": "backbone", "bank": "bank", "memory": "memory_layers"}
  state = nnx.state(abstract_model(config), nnx.Param)
  for path, leaf in nnx.to_flat_state(state):
    if param_groups(path) == "fixed":
      continue
    n = int(np.prod(leaf.shape))
    if key[param_groups(path)] == "bank":  # rows (chapters, slots) padded for sharding are not parameters
      n = n // leaf.shape[1] * bank_shape(config).rows
    counts[key[param_groups(path)]] += n
  counts["total"] = sum(counts.values())
  return counts
