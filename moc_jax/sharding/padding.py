"""Chapter padding: the bank's device layout <-> the user view that checkpoints hold.

The bank's chapter axis may be sharded (the `memory` axis by default). When the chapter count does not
divide the shard count it is padded with zero chapters that no router logit points at; `pad_tree` /
`unpad_tree` convert between that device layout and the user view (unpadded). A product-key value table
(memory.kind pkm / hml) is padded the same way along its slots, which no product key names.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax

from moc_jax.sharding.mesh import shards


def padded_chapters(config, bank, sizes: dict | None = None) -> int:
  """Rows of the bank as stored on the devices: its chapters (or a value table's slots; `bank` is
  `config.bank_shape(config)`, which the caller passes so that the layout stays below the config's plan) rounded up
  to the shard count of their logical axis under `config`'s rules and mesh."""
  n = shards(config, bank.row_axis, sizes)
  return -(-bank.rows // n) * n


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


def map_bank(fn, tree, *rest):
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
  out_shardings = map_bank(lambda x, bank: _user_sharding(x.sharding, x.shape) if bank else x.sharding, tree)
  cut = functools.partial(map_bank, lambda x, bank: x[:, :padding.real] if bank else x)
  return jax.jit(cut, out_shardings=out_shardings)(tree)


def pad_tree(tree, padding: ChapterPadding, shardings):
  """The device layout from the user view: zero chapters appended (inert: never routed to)."""
  if not padding.active:
    return tree
  extra = padding.padded - padding.real

  def grow(x, bank):
    return jax.numpy.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) if bank else x

  return jax.jit(functools.partial(map_bank, grow), out_shardings=shardings)(tree)


def user_view_abstract(abstract, padding: ChapterPadding):
  """Restore targets in the user view (unpadded chapter axis, shardings that divide it)."""
  if not padding.active:
    return abstract

  def view(a, bank):
    if not bank:
      return a
    shape = (a.shape[0], padding.real, *a.shape[2:])
    return jax.ShapeDtypeStruct(shape, a.dtype, sharding=_user_sharding(a.sharding, a.shape))

  return map_bank(view, abstract)


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
