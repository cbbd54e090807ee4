"""The value table of the product-key memories (memory.kind pkm, hml) and the one way it is read: a weighted sum
of rows, on one device or with the slots split over the mesh.

The table is one parameter [tables, N, d_v] (a table per bank of memory.sharing: Memory+ shares one by every
memory layer) whose slot axis carries the logical name `slots` and whose width carries `value_embed`; the rules
table maps `slots` to the `memory` mesh axis. It sits where the chapter bank does (`Transformer.bank.memory`), so
it is the optimizer's 'bank' group, checkpoints, pads and trains lazily as the bank does.

`read_rows` is an EmbeddingBag sum, out = sum_s weights[s] * table[ids[s]]; its gradient in the table is a
scatter-add into the rows read. When `slots` is split over devices (over mesh axes that also split `batch`, as
for the chapter bank) each device holds N/n slots and its own slice of the batch: the ids and weights of the n
devices sharing the table are all-gathered (bytes per slot read), each device sums the rows it owns (the others
count zero) and a reduce-scatter hands each device the sums of its rows. The table never moves, and the backward
pass scatter-adds into each device's own shard.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.model.chapter_read import sum_by_owner
from moc_jax.model.layers import param_init
from moc_jax.model.memory import rows_in_use


class ValueTable(nnx.Module):
  """The value table(s) [tables, N, d_v], N = memory.pkm_sub_keys**2. pkm: d_v = pkm_value_dim (d_model by
  default), drawn N(0, 1/d_v) as Memory+; hml: d_v = the head width, zeros, so a new hml block adds nothing.
  `padded_rows` >= N rounds the slot axis up to its shard count with zero rows that no product key names."""

  def __init__(self, cfg, tables, rngs, padded_rows=None):
    m, mem = cfg.model, cfg.memory
    rows = mem.pkm_sub_keys ** 2
    width = (mem.pkm_value_dim or m.d_model) if mem.kind == "pkm" else m.d_model // m.num_heads
    std = width ** -0.5 if mem.kind == "pkm" else 0.0
    self.memory = nnx.Param(param_init(std, "banks", "slots", "value_embed")(rngs.params(), (tables, rows, width)))
    extra = (padded_rows or rows) - rows
    if extra:
      self.memory.set_value(jnp.pad(self.memory[...], ((0, 0), (0, extra), (0, 0))))

  def read(self):
    return self.memory[...]


def read_slots(bank, ids, weights, sum_heads):
  """What a product-key lookup read: ids, weights [B, L, H, k] of `bank` (the table [N, d], or a `BankRows`) ->
  (the weighted rows summed per head [B, L, H, d], or over the heads too [B, L, d] (`sum_heads`, Memory+'s one
  bag); {"slots": ids, and with a BankRows "rows": the table rows it gathered}), float32."""
  table, slots, rows = rows_in_use(bank, ids, 0)
  if sum_heads:
    slots, weights = (x.reshape(x.shape[:2] + (-1,)) for x in (slots, weights))
  stats = {"slots": ids} if rows is None else {"slots": ids, "rows": rows}
  return read_rows(table, slots, weights), stats


def bag(table, ids, weights):
  """sum_s weights[..., s] * table[ids[..., s]] -> [..., d] float32 (table [N, d] on this device), a slot at a
  time: each step gathers one row per position and adds it, and the backward pass gathers it again, so no
  [..., S, d] array of the rows read is ever built (S = heads x k rows per position)."""
  @jax.checkpoint
  def add(total, slot):
    i, w = slot
    return total + w[..., None] * table.take(i, axis=0).astype(jnp.float32), None

  slots = (jnp.moveaxis(ids, -1, 0), jnp.moveaxis(weights.astype(jnp.float32), -1, 0))
  return jax.lax.scan(add, jnp.zeros(ids.shape[:-1] + table.shape[-1:], jnp.float32), slots)[0]


def read_rows(table, ids, weights):
  """`bag` of table [N, d] with ids int [B, ..., S] and weights [B, ..., S] -> [B, ..., d] float32, on the
  active mesh (module docstring; chapter_read.sum_by_owner)."""
  lead = ids.shape[:-1]
  ids, weights = (x.reshape(lead[0], -1, x.shape[-1]) for x in (ids, weights))

  def read(rows, ids, weights, hit=None):
    return bag(rows, ids, weights if hit is None else jnp.where(hit, weights, 0))

  out = sum_by_owner(table, ("slots", "value_embed"), (ids, weights), read)
  return out.reshape(lead + (table.shape[-1],))
