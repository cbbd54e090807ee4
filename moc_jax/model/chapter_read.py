"""Reading the selected chapters out of the bank, replicated or sharded on its chapter axis.

Replicated bank: a plain gather. Bank sharded over the mesh axes of the logical `chapters` axis
(which must also split the batch): each device holds C/n chapters and its own slice of the batch. A
gather on such an operand would all-gather the whole bank onto every device each step. Instead, two
exact strategies, each moving and holding at most the smaller of "the bank" and "the selections of
the n devices sharing it":

* `scatter` — the chapter ids of the n devices are all-gathered (a few KB); every device copies out
  the requested chapters it owns and a reduce-scatter returns each device its own selection.
  Traffic and temporaries ~ n x (a device's selection). Plain autodiff (gather / scatter-add).
* `ring` — the chapter shards travel round a ring (n-1 `ppermute`s) and each device copies out its
  chapters from the shard it holds; the backward pass runs the same ring with a shard-sized gradient
  accumulator that ends on the shard's owner. Traffic ~ the bank; resident: two shards + selection.

`auto` takes `scatter` when a device's requests (batch x slots) are fewer than a shard's chapters.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from moc_jax.sharding import current, logical_spec


def read_chapters(bank, ids, strategy="auto"):
  """bank [C, T, d], ids [B, S] int -> [B, S, T, d] (bank[ids]); `strategy` auto | ring | scatter."""
  chapter_axes, mesh = current("chapters")
  if not chapter_axes:
    return jnp.take(bank, ids, axis=0)
  bank_spec = logical_spec(mesh, "chapters", "chapter_tokens", "bank_embed")
  ids_spec = logical_spec(mesh, "batch", None)
  if not set(chapter_axes) <= set(current("batch")[0]):
    raise ValueError(f"the bank's chapter axis is sharded over {chapter_axes}, which must also split "
                     "`batch` (config.logical_axis_rules)")
  gathered = [(dim, bank_spec[dim]) for dim in (1, 2) if bank_spec[dim]]

  def local(bank_shard, ids_shard):
    for dim, split in gathered:  # FSDP/tensor splits of a chapter are re-joined (one shard at a time)
      bank_shard = jax.lax.all_gather(bank_shard, split, axis=dim, tiled=True)
    scatter = ids_shard.size < bank_shard.shape[0] if strategy == "auto" else strategy == "scatter"
    return (_scatter_take if scatter else _ring_take)(bank_shard, ids_shard, chapter_axes)

  return jax.shard_map(local, mesh=mesh, in_specs=(bank_spec, ids_spec),
                       out_specs=logical_spec(mesh, "batch", None, None, None), check_vma=False)(bank, ids)


def _owned(ids, owner, per):
  """Local row of each requested chapter in `owner`'s shard (clipped) and whether it lives there."""
  local = ids - owner * per
  return jnp.clip(local, 0, per - 1), (local >= 0) & (local < per)


def _scatter_take(shard, ids, axes):
  """bank[ids]: owners copy out what the group asked for; a reduce-scatter hands each device its part."""
  group_ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)
  local, hit = _owned(group_ids, jax.lax.axis_index(axes), shard.shape[0])
  part = jnp.where(hit[:, :, None, None], jnp.take(shard, local, axis=0), 0)
  return jax.lax.psum_scatter(part, axes, scatter_dimension=0, tiled=True)


def _right(n):
  return [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_take(shard, ids, axes):
  """bank[ids] where `shard` is this device's block of chapters along mesh axes `axes`."""
  n, per = _axis_size(axes), shard.shape[0]
  me = jax.lax.axis_index(axes)

  def copy_out(owner, held, out):
    local, hit = _owned(ids, owner, per)
    return jnp.where(hit[:, :, None, None], jnp.take(held, local, axis=0), out)

  def step(i, carry):  # `held` came from the device i places to the left
    held, out = carry
    return jax.lax.ppermute(held, axes, _right(n)), copy_out((me - i) % n, held, out)

  out = jnp.zeros(ids.shape + shard.shape[1:], shard.dtype)
  held, out = jax.lax.fori_loop(0, n - 1, step, (shard, out))
  return copy_out((me - n + 1) % n, held, out)


def _ring_take_fwd(shard, ids, axes):
  return _ring_take(shard, ids, axes), (ids, jnp.zeros((shard.shape[0], 0), shard.dtype))


def _ring_take_bwd(axes, res, g):
  ids, like = res  # `like`: the shard's row count and dtype, without keeping the shard
  n, per, dtype = _axis_size(axes), like.shape[0], like.dtype
  shape = (per,) + g.shape[2:]
  me = jax.lax.axis_index(axes)

  def add(i, acc):  # at step i this device holds the accumulator of the shard owned i+1 places left
    local, hit = _owned(ids, (me - i - 1) % n, per)
    return acc.at[local].add(jnp.where(hit[:, :, None, None], g, 0).astype(dtype))

  def step(i, acc):
    return jax.lax.ppermute(add(i, acc), axes, _right(n))

  acc = jax.lax.fori_loop(0, n - 1, step, jnp.zeros(shape, dtype))
  return add(n - 1, acc), None


_ring_take.defvjp(_ring_take_fwd, _ring_take_bwd)


def _axis_size(axes):
  size = 1
  for a in axes:
    size *= jax.lax.axis_size(a)
  return size
