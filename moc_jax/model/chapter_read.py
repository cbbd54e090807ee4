"""Reading the selected chapters out of the bank, replicated or sharded on its chapter axis.

Replicated bank: a plain gather. Bank sharded over the mesh axes of the logical `chapters` axis
(which must also split the batch): each device holds C/n chapters and its own slice of the batch. A
gather on such an operand would all-gather the whole bank onto every device each step; instead the
chapter shards travel round a ring (n-1 `ppermute`s) and each device copies out the chapters its
sequences selected from the shard it holds — at most two shards and the device's own selection are
ever resident. The backward pass runs the same ring with a shard-sized gradient accumulator that ends
on the shard's owner, so the bank gradient is never replicated either. Both directions are exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.core import spmd

from moc_jax.sharding import current, mesh_axes_of


def read_chapters(bank, ids):
  """bank [C, T, d], ids [B, S] int -> [B, S, T, d] (bank[ids])."""
  chapter_axes, mesh = current("chapters")
  if not chapter_axes:
    return jnp.take(bank, ids, axis=0)
  rules = spmd.get_logical_axis_rules()

  def spec(*names):
    return jax.P(*[tuple(a for a in mesh_axes_of(rules, n) if mesh.shape[a] > 1) or None for n in names])

  bank_spec, ids_spec = spec("chapters", "chapter_tokens", "embed"), spec("batch", None)
  if not set(chapter_axes) <= set(ids_spec[0] or ()):
    raise ValueError(f"the bank's chapter axis is sharded over {chapter_axes}, which must also split "
                     "`batch` (config.logical_axis_rules)")
  gathered = [(i, axes) for i, axes in ((1, bank_spec[1]), (2, bank_spec[2])) if axes]

  def local(bank_shard, ids_shard):
    for dim, axes in gathered:  # FSDP/tensor splits of a chapter are re-joined (one shard at a time)
      bank_shard = jax.lax.all_gather(bank_shard, axes, axis=dim, tiled=True)
    return _ring_take(bank_shard, ids_shard, chapter_axes)

  return jax.shard_map(local, mesh=mesh, in_specs=(bank_spec, ids_spec),
                       out_specs=spec("batch", None, None, None), check_vma=False)(bank, ids)


def _ring_take(shard, ids, axes):
  """bank[ids] where `shard` is this device's block of chapters along mesh axes `axes`."""
  n = _axis_size(axes)
  per = shard.shape[0]
  right = [(j, (j + 1) % n) for j in range(n)]

  def owned_by(owner):
    local = ids - owner * per
    hit = (local >= 0) & (local < per)
    return jnp.clip(local, 0, per - 1), hit

  @jax.custom_vjp
  def take(shard):
    me = jax.lax.axis_index(axes)

    def step(i, carry):
      held, out = carry
      local, hit = owned_by((me - i) % n)  # `held` came from the device i places to the left
      out = jnp.where(hit[:, :, None, None], jnp.take(held, local, axis=0), out)
      return jax.lax.ppermute(held, axes, right), out

    out = jnp.zeros(ids.shape + shard.shape[1:], shard.dtype)
    held, out = jax.lax.fori_loop(0, n - 1, step, (shard, out))
    local, hit = owned_by((me - (n - 1)) % n)
    return jnp.where(hit[:, :, None, None], jnp.take(held, local, axis=0), out)

  def fwd(shard):
    return take(shard), None

  def bwd(_, g):
    me = jax.lax.axis_index(axes)

    def add(i, acc):  # at step i this device holds the accumulator of the shard owned i+1 places left
      local, hit = owned_by((me - i - 1) % n)
      return acc.at[local].add(jnp.where(hit[:, :, None, None], g, 0).astype(acc.dtype))

    def step(i, acc):
      return jax.lax.ppermute(add(i, acc), axes, right)

    acc = jax.lax.fori_loop(0, n - 1, step, jnp.zeros(shard.shape, shard.dtype))
    return (add(n - 1, acc),)

  take.defvjp(fwd, bwd)
  return take(shard)


def _axis_size(axes):
  size = 1
  for a in axes:
    size *= jax.lax.axis_size(a)
  return size
