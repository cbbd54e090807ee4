"""`memory.kind=hml`: MIDUS's head-wise memory block with HIVE (MIDUS, "Memory-Infused Depth Up-Scaling",
Eq. 16-19), a block of its own that runs before each memory layer's block.

    a = Attn'(RMSNorm(x))      multi-head self-attention without its output projection: heads a_h [d_h]
    per head: the top-k slots of q_h = a_h by the head's own product keys (no query projection)
    M_h = W_h sum_k w * V[slot]   one value table V [N, d_h] shared by the heads (HIVE), a map W_h [d_h, d_h] per head
    M(x) = x + concat_h M_h    no MLP, no residual inside

V is the value table of the layer's bank (model/value_table.py; memory.sharing=per_layer gives every block its
own, as MIDUS has). It starts at zero, so m = 0 and a block added to a model leaves its outputs as they were;
W_h starts at the identity, so V's first gradients are the heads' own. Parameters per block: the attention's
q, k, v, the sub-keys 2*H*n*d_h/2, H*d_h^2 for the maps, and N*d_h per table (HIVE, instead of H*N*d_h).

Placement: memory layer i of the plan runs this block, then layer i's own block (MIDUS inserts a memory block
before the block whose attention it copies). A model with hml memory at layers I is its backbone with one
memory block before each layer of I: `memory.placement` and `layer_indices` say where blocks are inserted.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from moc_jax.model.layers import RMSNorm, SelfAttention
from moc_jax.model.product_keys import ProductKeys
from moc_jax.model.value_table import read_slots


class HMLBlock(nnx.Module):
  """One hml memory block: norm, attention without W_o, per-head product keys and maps (its value table is the
  model's bank, passed in)."""

  def __init__(self, cfg, rngs):
    m, mem = cfg.model, cfg.memory
    self.heads, self.head_dim = m.num_heads, m.d_model // m.num_heads
    self.dtype = jnp.dtype(m.compute_dtype)
    self.norm = RMSNorm(m.d_model, m.norm_eps)
    self.attn = SelfAttention(cfg, rngs, output_projection=False)
    self.keys = ProductKeys(self.heads, mem.pkm_sub_keys, self.head_dim, mem.pkm_top_k, mem.pkm_query_norm,
                            m.norm_eps, m.compute_dtype, rngs)
    eye = jnp.broadcast_to(jnp.eye(self.head_dim, dtype=jnp.float32), (self.heads, self.head_dim, self.head_dim))
    self.maps = nnx.Param(eye, out_sharding=("heads", None, None), eager_sharding=False)

  def __call__(self, h, bank, positions, mask):
    """h [B, L, d] -> (m [B, L, d] float32, the block adds it to h; {"slots": [B, L, H, k][, "rows"]})."""
    return self._read(self.attn(self.norm(h), positions, mask), bank)

  def decode(self, cache, h, bank, positions, mask, index):
    """Cached decoding of the new positions at slots [index, ...): `cache` holds the attention's keys and values
    {"k", "v"} [B, M, Hkv, dh] (model/decode.py) -> (cache, m)."""
    (k, v), heads = self.attn.decode((cache["k"], cache["v"]), self.norm(h), positions, mask, index)
    return {"k": k, "v": v}, self._read(heads, bank)[0]

  def _read(self, heads, bank):
    """The heads' outputs [B, L, H*dh] as queries -> (m, stats)."""
    b, length = heads.shape[:2]
    ids, weights = self.keys(heads.reshape(b, length, self.heads, self.head_dim))
    read, stats = read_slots(bank, ids, weights, sum_heads=False)  # [B, L, H, dh]
    m = jnp.einsum("blhd,hed->blhe", read.astype(self.dtype), self.maps[...].astype(self.dtype),
                   preferred_element_type=jnp.float32)
    return m.reshape(b, length, -1), stats
