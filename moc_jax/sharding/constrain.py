"""Shardings from logical axis names: parameters and optimizer state (nnx Variables carry their names),
batches, and activations pinned while a step is traced under `mesh.activate`.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from flax.core import spmd

from moc_jax.sharding.mesh import mesh_axes_of, rules_of


def logical_shardings(tree, mesh, rules):
  """NamedShardings from the logical axis names carried by nnx Variables (Adam moments inherit their
  parameter's names; counters and other leaves are replicated)."""
  with nnx.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(tree)
  return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)


def batch_spec(rules) -> jax.P:
  axes = mesh_axes_of(rules, "batch")
  return jax.P(axes if axes else None)


def data_sharding(config, mesh):
  """Batches are split along their first axis over the mesh axes the `batch` logical axis maps to."""
  return jax.sharding.NamedSharding(mesh, batch_spec(rules_of(config)))


def current(logical: str):
  """(mesh axes of `logical` that split it, abstract mesh) while tracing under `activate`;
  ((), None) otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return (), None
  return _splitting(mesh, spmd.get_logical_axis_rules(), logical), mesh


def _splitting(mesh, rules, logical):
  return tuple(a for a in mesh_axes_of(rules, logical) if mesh.shape[a] > 1) if logical else ()


def logical_spec(mesh, *logical) -> jax.P:
  """PartitionSpec of logical names (None = not split) under the active rules, on `mesh`."""
  rules = spmd.get_logical_axis_rules()
  return jax.P(*[_splitting(mesh, rules, n) or None for n in logical])


def constrain(x, *logical):
  """Pins an activation's layout by logical names (None = not split) while tracing under `activate`;
  without it GSPMD may split FSDP matmuls on the wrong side (e.g. gather logits instead of weights)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, logical_spec(mesh, *logical)))


def shard_bytes(abstract_tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, per leaf)."""
  total = 0
  for a in jax.tree.leaves(abstract_tree):
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    total += int(np.prod(shape)) * a.dtype.itemsize
  return total
