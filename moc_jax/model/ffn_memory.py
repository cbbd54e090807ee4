"""`memory.kind=ffn`: FFN memory fetched by the document's path down the cluster tree (Pouransari et al.,
"Pretraining with hierarchical memories", whose best memory type this is).

Each node of the tree owns `memory.cluster_chapters[l]` columns of a SwiGLU FFN (a chapter of this kind's bank is
one column: its gate, up and down vectors), and a memory layer's MLP is widened by the columns of its position's
path (and the `num_shared` columns every position reads):

    x = mlp_norm(h)                              (the block's MLP input: the columns widen that MLP)
    out = MLP(x) + sum over fetched columns s of silu(x . gate_s) * (x . up_s) * down_s

which is the MLP with the fetched columns concatenated to its inner dimension. The down vectors start at zero,
so an untrained memory adds nothing (the gate and up vectors are drawn as memory.init_std says). The bank is
[tables, columns, 3, d] with the chapter bank's logical axes (a column's three vectors on `chapter_tokens`), so
it pads, shards over the `memory` mesh axis, checkpoints and trains lazily (only the columns fetched) exactly as a
chapter bank does, and the level knock-outs of `moc_jax.eval` zero a level's columns.

Cost per token: 6 * d per fetched column (forward); the fetched columns are gathered per position, so a packed
row of several documents reads each document's own columns.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.model.chapter_read import sum_by_owner
from moc_jax.model.layers import param_init
from moc_jax.model.memory import rows_in_use
from moc_jax.model.routing import cluster_reads, cluster_tree

GATE, UP, DOWN = 0, 1, 2  # a column's three vectors along the bank's chapter_tokens axis


class ColumnBank(nnx.Module):
  """The FFN memory's columns [tables, columns, 3, d]: gate and up vectors N(0, memory.init_std), down vectors
  zero. `padded_chapters` >= memory.num_chapters rounds the column axis up to its shard count with zero columns
  no path names."""

  def __init__(self, cfg, num_banks, rngs, padded_chapters=None):
    mem = cfg.memory
    shape = (num_banks, mem.num_chapters, 3, cfg.model.d_model)
    columns = param_init(mem.init_std, "banks", "chapters", "chapter_tokens", "bank_embed")(rngs.params(), shape)
    self.memory = nnx.Param(columns)
    extra = (padded_chapters or mem.num_chapters) - mem.num_chapters
    self.memory.set_value(jnp.pad(self.memory[...].at[:, :, DOWN].set(0.0), ((0, 0), (0, extra), (0, 0), (0, 0))))

  def read(self):
    return self.memory[...]


class FFNMemory(nnx.Module):
  """The fetched columns of one memory layer's MLP (its bank is the model's `ColumnBank`, passed in as a chapter
  bank is to `MemoryLayer`). Called with the block's MLP input, its output is added to the MLP's."""

  def __init__(self, cfg, rngs):
    del rngs  # every parameter of this memory is in the bank
    self.num_shared, self.tree = cfg.memory.num_shared, cluster_tree(cfg)
    self.dtype = jnp.dtype(cfg.model.compute_dtype)

  def __call__(self, x, route_input, bank, valid=None, segments=None, paths=None):
    """x [B, L, d] (the MLP's normed input), `bank` the columns [C, 3, d] (or a `BankRows`), `paths` [B, L, levels]
    -> (the fetched columns' output [B, L, d] float32, stats). Stats as cluster routing's chapter read reports them:
    `chapters` [B, L, S] the columns each position read, `load` [C] the reads per path-owned column over the real
    positions[, `rows` of a BankRows]."""
    del route_input, segments
    if paths is None:
      raise ValueError("memory.kind=ffn fetches the columns of each document's cluster path: pass cluster_path "
                       "[B, L, levels] (the batch's, with data.cluster.k > 0)")
    columns, load = cluster_reads(paths, self.num_shared, self.tree, valid)
    stats = {"chapters": columns, "load": load}
    table, ids, rows = rows_in_use(bank, columns, self.num_shared)
    if rows is not None:
      stats["rows"] = rows
      return column_sum(table, x.astype(self.dtype), ids), stats
    return read_columns(table, x.astype(self.dtype), ids), stats


def column_sum(table, x, ids, keep=None):
  """sum_s silu(x . gate[ids_s]) * (x . up[ids_s]) * down[ids_s] -> [B, L, d] float32 (table [C, 3, d] on this
  device, x [B, L, d], ids [B, L, S], `keep` [B, L, S] bool: the columns that count, all by default), a column at a
  time: each step gathers one column per position, and the backward pass gathers it again, so no [B, L, S, 3, d]
  array of the fetched columns is ever built."""
  @jax.checkpoint
  def add(total, column):
    i, kept = column
    vectors = table.take(i, axis=0).astype(x.dtype)  # [B, L, 3, d]
    gate, up = (jnp.einsum("bld,bld->bl", x, vectors[..., j, :], preferred_element_type=jnp.float32)
                for j in (GATE, UP))
    act = jax.nn.silu(gate) * up * kept
    return total + act[..., None] * vectors[..., DOWN, :].astype(jnp.float32), None

  keep = jnp.ones(ids.shape, jnp.float32) if keep is None else keep.astype(jnp.float32)
  columns = (jnp.moveaxis(ids, -1, 0), jnp.moveaxis(keep, -1, 0))
  return jax.lax.scan(add, jnp.zeros(x.shape, jnp.float32), columns)[0]


def read_columns(table, x, ids):
  """`column_sum` on the active mesh: with the columns split over devices, each device sums the columns it owns for
  the positions of every device sharing them (chapter_read.sum_by_owner)."""
  return sum_by_owner(table, ("chapters", "chapter_tokens", "bank_embed"), (ids, x),
                      lambda rows, ids, x, hit=None: column_sum(rows, x, ids, hit))
