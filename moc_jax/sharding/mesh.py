"""The device mesh: its axis sizes from `config.mesh`, the logical-axis rules table, and the checks that a
config's mesh fits the devices and divides every sharded dimension.

`config.mesh` gives the size of each mesh axis (`data`, `fsdp`, `tensor`, `memory`; -1 fills with the
remaining devices) and `config.logical_axis_rules` maps the model's logical names to them. Model code
names logical axes only; `activate(mesh, rules)` makes both visible while a step is traced.
"""
from __future__ import annotations

import contextlib
import math

import jax
from flax import nnx

from moc_jax.errors import ConfigError

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


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """The mesh for `config` over `devices` (default: all), every axis Auto (GSPMD propagation). On a TPU slice
  JAX lays each mesh axis along whole axes of the physical torus; a size that is no product of them (8 on a
  4x4x4 v5p slice) is a ConfigError naming the sizes that are."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(config, len(devices))
  try:
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
  except NotImplementedError as e:  # jax's mesh_utils: no assignment of the axes to the physical torus
    why = str(e).split(". ")[0]  # names the axis and the physical axes left
    raise ConfigError(f"config.mesh: {_fmt(sizes)} does not lay out on the torus of the {len(devices)} "
                      f"{devices[0].device_kind} devices ({why}) — make each axis size a product of some of the "
                      "slice's physical axis sizes") from None


@contextlib.contextmanager
def activate(mesh, rules):
  """Mesh and logical rules visible to tracing (the bank read looks them up to shard its work)."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield


def validate_mesh(c, dims: dict[str, list[tuple[str, int]]]) -> None:
  """The mesh must fit the devices, and every dimension in `dims` ({logical axis: [(field, size)]}) must
  divide by its shard count (chapters are padded instead, so they are not in `dims`); ConfigError otherwise."""
  sizes = mesh_shape(c, num_devices(c))
  rules = rules_of(c)
  for name, _ in rules:
    unknown = [a for a in mesh_axes_of(rules, name) if a not in sizes]
    if unknown:
      raise ConfigError(f"config.logical_axis_rules: {name!r} maps to unknown mesh axes {unknown} — "
                        f"use axes of {list(sizes)}")
  for name, fields in dims.items():
    n = shards(c, name, sizes)
    for field, size in fields:
      if size % n:
        raise ConfigError(f"config.{field}: {size} is not divisible by the {n} shards of logical axis {name!r} "
                          f"(mesh {sizes}, rule {dict(rules).get(name)!r}) — change the mesh or logical_axis_rules")
  rows, what = {"chapters": ("chapters", "chapters"), "ffn": ("chapters", "columns")}.get(c.memory.kind,
                                                                                      ("slots", "value slots"))
  row_axes = {a for a in mesh_axes_of(rules, rows) if sizes[a] > 1}  # the bank's rows (config.bank_shape)
  if row_axes - set(mesh_axes_of(rules, "batch")):
    raise ConfigError(f"config.logical_axis_rules: the bank's {what} are split over {sorted(row_axes)} but "
                      "'batch' is not — add those mesh axes to the 'batch' rule (the memory axis carries its own "
                      "slice of the batch)")
