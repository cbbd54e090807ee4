"""The device mesh and the one place logical axis names meet mesh axes.

`config.mesh` gives the size of each mesh axis (`data`, `fsdp`, `tensor`, `memory`; -1 fills with the
remaining devices) and `config.logical_axis_rules` maps the model's logical names to them. Model code
names logical axes only; `activate(mesh, rules)` makes both visible while a step is traced.

The bank's chapter axis may be sharded (the `memory` axis by default). When the chapter count does not
divide the shard count it is padded with zero chapters that no router logit points at; `pad_tree` /
`unpad_tree` convert between that device layout and the user view (unpadded) that checkpoints hold.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import numpy as np
from flax import nnx
from flax.core import spmd

from moc_jax.config import ConfigError

MESH_AXES = ("data", "memory", "fsdp", "tensor")  # outermost (cross-host friendly) to innermost


def rules_of(config) -> tuple:
  return tuple((name, tuple(a) if isinstance(a, (list, tuple)) else a) for name, a in config.logical_axis_rules)


def mesh_axes_of(rules, logical: str) -> tuple[str, ...]:
  """Mesh axes a logical name maps to (a rule may name one axis, several, or None)."""
  target = dict(rules).get(logical)
  if target is None:
    return ()
  return tuple(target) if isinstance(target, tuple) else (target,)


def mesh_shape(config, num_devices: int) -> dict[str, int]:
  """Axis sizes with -1 resolved; ConfigError if they do not multiply to `num_devices`."""
  sizes = {a: config.mesh[a] for a in MESH_AXES}
  bad = [a for a, s in sizes.items() if not isinstance(s, int) or s == 0 or s < -1]
  if bad:
    raise ConfigError(f"config.mesh.{bad[0]}: {sizes[bad[0]]!r} is not a size — use a positive int or -1 (fill)")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"config.mesh: {fill} are all -1 — at most one axis can fill the remaining devices")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % known:
      raise ConfigError(f"config.mesh: {num_devices} devices are not divisible by the fixed axes "
                        f"({_fmt(sizes)}) — change the axis sizes")
    sizes[fill[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f"config.mesh: {_fmt(sizes)} needs {math.prod(sizes.values())} devices but there are "
                      f"{num_devices} — make the sizes multiply to {num_devices} or set one axis to -1")
  return sizes


def _fmt(sizes):
  return " x ".join(f"{a}={s}" for a, s in sizes.items())


def num_devices(config) -> int:
  return config.num_fake_devices or jax.device_count()


def shards(config, logical: str, sizes: dict | None = None) -> int:
  """How many ways the logical axis is split under `config`'s rules and mesh (the device count is
  consulted only when one of its mesh axes is -1)."""
  axes = mesh_axes_of(rules_of(config), logical)
  if sizes is None and any(config.mesh[a] == -1 for a in axes):
    sizes = mesh_shape(config, num_devices(config))
  return math.prod((sizes or config.mesh)[a] for a in axes)


def padded_chapters(config, sizes: dict | None = None) -> int:
  """Chapters as stored on the devices: num_chapters rounded up to the chapter axis's shard count."""
  n = shards(config, "chapters", sizes)
  return -(-config.memory.num_chapters // n) * n


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """The mesh for `config` over `devices` (default: all), every axis Auto (GSPMD propagation)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(config, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def activate(mesh, rules):
  """Mesh and logical rules visible to tracing (the bank read looks them up to shard its work)."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield


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


# --- chapter padding: device layout <-> user view --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChapterPadding:
  """Chapters of the bank as users see them (`real`) and as stored on the devices (`padded`).

  Applies to the bank parameter [banks, chapters, T, d] and its optimizer moments (chapter axis 1).
  """
  real: int
  padded: int

  @property
  def active(self):
    return self.padded != self.real


def _path_names(path):
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _map_bank(fn, tree, *rest):
  """fn(leaf, *rest_leaves, is_bank) over `tree` (its structure leads)."""
  return jax.tree_util.tree_map_with_path(lambda p, x, *r: fn(x, *r, _is_bank(_path_names(p))), tree, *rest)


def _is_bank(names):
  """The bank parameter `bank/memory` or a moment of it (not, e.g., an optimizer group named "bank")."""
  return any(a == "bank" and b == "memory" for a, b in zip(names, names[1:]))


def unpad_tree(tree, padding: ChapterPadding):
  """The user view of `tree`: padded chapters dropped. One jit whose outputs keep the chapter shards'
  memory spread (the split moves to another dimension it divides), so no device holds a whole bank."""
  if not padding.active:
    return tree
  out_shardings = _map_bank(lambda x, bank: _user_sharding(x.sharding, x.shape) if bank else x.sharding, tree)
  cut = functools.partial(_map_bank, lambda x, bank: x[:, :padding.real] if bank else x)
  return jax.jit(cut, out_shardings=out_shardings)(tree)


def pad_tree(tree, padding: ChapterPadding, shardings):
  """The device layout from the user view: zero chapters appended (inert: never routed to)."""
  if not padding.active:
    return tree
  extra = padding.padded - padding.real

  def grow(x, bank):
    return jax.numpy.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) if bank else x

  return jax.jit(functools.partial(_map_bank, grow), out_shardings=shardings)(tree)


def user_view_abstract(abstract, padding: ChapterPadding):
  """Restore targets in the user view (unpadded chapter axis, shardings that divide it)."""
  if not padding.active:
    return abstract

  def view(a, bank):
    if not bank:
      return a
    shape = (a.shape[0], padding.real, *a.shape[2:])
    return jax.ShapeDtypeStruct(shape, a.dtype, sharding=_user_sharding(a.sharding, a.shape))

  return _map_bank(view, abstract)


def _user_sharding(sharding, shape, axis=1):
  """`sharding` with the chapter axis's mesh axes moved to the first other dimension they divide."""
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  moved, spec[axis] = spec[axis], None
  if moved is not None:
    moved = moved if isinstance(moved, tuple) else (moved,)
    for d, n in enumerate(shape):
      have = spec[d] if isinstance(spec[d], tuple) else ((spec[d],) if spec[d] else ())
      if d != axis and n % math.prod(sharding.mesh.shape[a] for a in have + moved) == 0:
        spec[d] = have + moved
        break
  return jax.sharding.NamedSharding(sharding.mesh, jax.P(*spec))


def shard_bytes(abstract_tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, per leaf)."""
  total = 0
  for a in jax.tree.leaves(abstract_tree):
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    total += int(np.prod(shape)) * a.dtype.itemsize
  return total
