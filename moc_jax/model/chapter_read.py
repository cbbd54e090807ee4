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

Per-position routing (`routed_attention`) never moves the bank: keys and values are projected where
the chapters live, and the routed attention runs as expert parallelism over chapters. The queries of
the n devices sharing a bank are all-gathered, each device attends with the chapters it owns (other
slots empty) and the partial results return by reduce-scatter — summed (per-slot softmax) or merged by
log-sum-exp (joint softmax). Sending every query to every owner is the right dispatch here: with S
slots per token over n shards a token misses a shard with probability ~(1 - 1/n)^S (2e-4 for S = 64,
n = 8), so a ragged all-to-all would move the same bytes with more bookkeeping.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.routed_chapter_attention import routed_chapter_attention
from moc_jax.model.quantize import QuantizedRows, dequantize
from moc_jax.sharding import current, logical_spec


def read_chapters(bank, ids, strategy="auto"):
  """bank [C, T, d], ids [B, S] int -> float [B, S, T, d] (bank[ids]); `strategy` auto | ring | scatter.

  A quantized bank (`quantize.QuantizedRows`) is read the same way: its codes and scales are taken
  (and moved between devices) and only the selected chapters are dequantised.
  """
  chapter_axes, mesh = current("chapters")
  if not chapter_axes:
    return dequantize(bank.take(ids, axis=0))
  bank_spec = logical_spec(mesh, "chapters", "chapter_tokens", "bank_embed")
  ids_spec = logical_spec(mesh, "batch", None)
  if not set(chapter_axes) <= set(current("batch")[0]):
    raise ValueError(f"the bank's chapter axis is sharded over {chapter_axes}, which must also split "
                     "`batch` (config.logical_axis_rules)")
  if isinstance(bank, QuantizedRows):  # scales [C, T]: the bank's spec without the row dimension
    bank_spec = QuantizedRows(bank_spec, jax.P(*bank_spec[:2]), bank.bits)

  def local(bank_shard, ids_shard):
    scatter = ids_shard.size < bank_shard.shape[0] if strategy == "auto" else strategy == "scatter"

    def take(shard, spec):  # FSDP/tensor splits of a chapter are re-joined (one shard at a time)
      for dim, split in enumerate(spec[1:], 1):
        if split:
          shard = jax.lax.all_gather(shard, split, axis=dim, tiled=True)
      return (_scatter_take if scatter else _ring_take)(shard, ids_shard, chapter_axes)

    return dequantize(jax.tree.map(take, bank_shard, bank_spec))

  return jax.shard_map(local, mesh=mesh, in_specs=(bank_spec, ids_spec),
                       out_specs=logical_spec(mesh, "batch", None, None, None), check_vma=False)(bank, ids)


def routed_attention(q, k, v, ids, logit_scale, value_scale, *, combine, implementation="auto", chunk=0):
  """`routed_chapter_attention` (q [B,L,H,dh], k/v [C,T,Hkv,dh], ids/scales [B,L,S]) on the active mesh.

  Without a mesh: one call. With one: a shard_map per device (a Pallas call cannot be partitioned by
  GSPMD); when `chapters` is split, expert parallelism as described above. `chunk` > 0 (memory.read_chunk):
  `in_chunks`.
  """
  if 0 < chunk < q.shape[1]:
    read = functools.partial(routed_attention, k=k, v=v, combine=combine, implementation=implementation)
    return in_chunks(lambda q, ids, ls, vs: read(q, ids=ids, logit_scale=ls, value_scale=vs),
                     q, ids, logit_scale, value_scale, chunk)
  call = functools.partial(routed_chapter_attention, combine=combine, implementation=implementation)
  chapter_axes, mesh = current("chapters")
  if mesh is None:
    return call(q, k, v, ids, logit_scale, value_scale)
  q_spec = logical_spec(mesh, "batch", None, "heads", None)
  kv_spec = logical_spec(mesh, "chapters", "chapter_tokens", "kv", None)
  slot_spec = logical_spec(mesh, "batch", None, None)
  if chapter_axes and not set(chapter_axes) <= set(current("batch")[0]):
    raise ValueError(f"the bank's chapter axis is sharded over {chapter_axes}, which must also split "
                     "`batch` (config.logical_axis_rules)")

  def local(q, k, v, ids, ls, vs):
    if not chapter_axes:
      return call(q, k, v, ids, ls, vs)
    gather = lambda x: jax.lax.all_gather(x, chapter_axes, axis=0, tiled=True)  # noqa: E731
    q, ids, ls, vs = map(gather, (q, ids, ls, vs))
    local_ids, hit = owned(ids, jax.lax.axis_index(chapter_axes), k.shape[0])
    local_ids = jnp.where(hit & (ids >= 0), local_ids, -1)
    scatter = lambda x: jax.lax.psum_scatter(x, chapter_axes, scatter_dimension=0, tiled=True)  # noqa: E731
    if combine == "moe":
      return scatter(call(q, k, v, local_ids, ls, vs))
    out, lse = call(q, k, v, local_ids, ls, vs, return_lse=True)
    w = jnp.exp(lse - jax.lax.pmax(jax.lax.stop_gradient(lse), chapter_axes))  # [B', L, H]
    total = scatter(w)[..., None]
    return scatter(out * w[..., None]) / jnp.where(total > 0, total, 1.0)

  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, slot_spec, slot_spec, slot_spec),
                       out_specs=q_spec, check_vma=False)(q, k, v, ids, logit_scale, value_scale)


def in_chunks(read, q, ids, logit_scale, value_scale, chunk):
  """read(q, ids, logit_scale, value_scale) of every `chunk` consecutive positions of each row in turn: a scan
  whose body is rematerialised, so the read's temporaries (the kernels' per-(token, slot) rows, the dispatch plan)
  are one slice's, forward and backward. Exact: each position reads its own slots. The last slice is padded with
  empty slots (id -1) and its padding cut off."""
  b, length = q.shape[:2]
  n = -(-length // chunk)

  def split(x, fill):
    x = jnp.pad(x, [(0, 0), (0, n * chunk - length)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  slices = (split(q, 0), split(ids, -1), split(logit_scale, 0), split(value_scale, 0))
  _, out = jax.lax.scan(jax.checkpoint(lambda carry, x: (carry, read(*x))), None, slices)
  return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :length]


def sum_by_owner(table, names, per_position, read):
  """read(table, ids, *rest, hit=None) on the active mesh, for a read that sums, per position, what the table rows it
  names contribute (a value table's weighted rows, FFN memory's columns). `names`: the table's logical axes, rows
  first; `per_position`: (ids, *rest), arrays [B, ...] split over `batch`. When the rows are split over devices
  (over mesh axes that must also split `batch`), the per-position arrays of the n devices sharing the table are
  all-gathered, each device calls `read` on the rows it owns with `hit` marking the ids it owns (their local ids
  clipped), and a reduce-scatter hands each device the sums of its own positions: the table never moves, and the
  backward pass scatter-adds into each device's own shard. The output is [B, ..., d], three axes."""
  axes, mesh = current(names[0])
  if not axes:
    return read(table, *per_position)
  if not set(axes) <= set(current("batch")[0]):
    raise ValueError(f"the bank's {names[0]} are sharded over {axes}, which must also split `batch` "
                     "(config.logical_axis_rules)")
  table_spec = logical_spec(mesh, *names)
  specs = [logical_spec(mesh, "batch", *(None,) * (x.ndim - 1)) for x in per_position]

  def local(shard, ids, *rest):
    for dim, split in enumerate(table_spec[1:], 1):  # splits of a row's other axes are re-joined
      if split:
        shard = jax.lax.all_gather(shard, split, axis=dim, tiled=True)
    ids, *rest = (jax.lax.all_gather(x, axes, axis=0, tiled=True) for x in (ids, *rest))
    local_ids, hit = owned(ids, jax.lax.axis_index(axes), shard.shape[0])
    part = read(shard, local_ids, *rest, hit=hit)
    return jax.lax.psum_scatter(part, axes, scatter_dimension=0, tiled=True)

  return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, *specs),
                       out_specs=logical_spec(mesh, "batch", None, None), check_vma=False)(table, *per_position)


def owned(ids, owner, per):
  """Local row of each requested row (a chapter, or a value slot) in `owner`'s shard of `per` rows (clipped), and
  whether it lives there."""
  local = ids - owner * per
  return jnp.clip(local, 0, per - 1), (local >= 0) & (local < per)


def _scatter_take(shard, ids, axes):
  """bank[ids]: owners copy out what the group asked for; a reduce-scatter hands each device its part."""
  group_ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)
  local, hit = owned(group_ids, jax.lax.axis_index(axes), shard.shape[0])
  part = jnp.take(shard, local, axis=0)
  part = jnp.where(_per_slot(hit, part), part, 0)
  return jax.lax.psum_scatter(part, axes, scatter_dimension=0, tiled=True)


def _per_slot(hit, x):
  """hit [B, S] broadcast against a chapter read x [B, S, ...] (chapters [.., T, d], scales [.., T])."""
  return hit.reshape(hit.shape + (1,) * (x.ndim - hit.ndim))


def _right(n):
  return [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ring_take(shard, ids, axes):
  """bank[ids] where `shard` is this device's block of chapters along mesh axes `axes`."""
  n, per = _axis_size(axes), shard.shape[0]
  me = jax.lax.axis_index(axes)

  def copy_out(owner, held, out):
    local, hit = owned(ids, owner, per)
    return jnp.where(_per_slot(hit, out), jnp.take(held, local, axis=0), out)

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
    local, hit = owned(ids, (me - i - 1) % n, per)
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
