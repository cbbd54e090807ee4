"""`memory.kind=pkm`: product-key memory as Memory+ builds it (Berges et al. 2024, "Memory Layers at Scale";
product keys: Lample et al. 2019), read where a memory layer reads.

    x = RMSNorm(h);  q_h = (x W_q)_h  (pkm_heads heads of pkm_key_dim)
    per head: the top-k slots of q_h and their softmax weights (model/product_keys.py)
    y = sum over heads and slots of w * V[slot]   (one EmbeddingBag sum of the heads' H*k rows, as Memory+)
    out = (y * silu(x W1)) W2                      (Memory+'s gated output; pkm_gated=False: out = y)

V is the value table of the layer's bank (memory.sharing: one table for every memory layer by default, as Memory+
shares its values), a slot a row, drawn N(0, 1/d_v) as Memory+ (model/value_table.py). W2 starts at zero under
memory.wo_init_zero, as the chapter read's W_o does, so an untrained memory adds nothing. Memory+ puts its memory
in place of the layer's MLP; here it takes the chapter read's place in the block (variant A: attention -> memory
-> MLP), so the kinds differ in the memory read alone, with the same placement, backbone and trainer.
Every token looks up its own slots: training, evaluation and cached decoding compute the same thing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moc_jax.model.layers import RMSNorm, dense
from moc_jax.model.product_keys import ProductKeys
from moc_jax.model.value_table import read_slots


class PKMLayer(nnx.Module):
  """The memory read of one pkm memory layer: query, product keys and the gated output (its value table is
  the model's bank, passed in as the chapter bank is to `MemoryLayer`)."""

  def __init__(self, cfg, rngs):
    m, mem = cfg.model, cfg.memory
    dt = jnp.dtype(m.compute_dtype)
    self.heads, self.key_dim, self.gated = mem.pkm_heads, mem.pkm_key_dim, mem.pkm_gated
    value_dim = mem.pkm_value_dim or m.d_model
    self.norm = RMSNorm(m.d_model, m.norm_eps)
    self.query = dense(m.d_model, self.heads * self.key_dim, m.init_std, ("embed", None), dt, rngs)
    self.keys = ProductKeys(self.heads, mem.pkm_sub_keys, self.key_dim, mem.pkm_top_k, mem.pkm_query_norm,
                            m.norm_eps, m.compute_dtype, rngs)
    if self.gated:
      self.gate = dense(m.d_model, value_dim, m.init_std, ("embed", "value_embed"), dt, rngs)
      self.out = dense(value_dim, m.d_model, 0.0 if mem.wo_init_zero else m.init_std, ("value_embed", "embed"), dt,
                       rngs)

  def __call__(self, h, route_input, bank, valid=None, segments=None, paths=None):
    """The read at the residual stream h [B, L, d] from `bank` (the value table [N, d_v], or a `BankRows`)
    -> (out [B, L, d], {"slots": [B, L, heads, k] the slots read[, "rows": the rows of a BankRows]}).
    `route_input`, `valid`, `segments` and `paths` are the chapter read's: a token's lookup needs its own input
    alone."""
    del route_input, valid, segments, paths
    x = self.norm(h)
    ids, weights = self.keys(self.query(x).reshape(x.shape[:2] + (self.heads, self.key_dim)))
    y, stats = read_slots(bank, ids, weights, sum_heads=True)
    if not self.gated:
      return y, stats
    return self.out(y * jax.nn.silu(self.gate(x).astype(jnp.float32))), stats

  def decode(self, state, h, route_input, bank, valid, index):
    """Cached decoding: each token's read needs nothing from earlier ones (`state` stays {})."""
    del index
    return state, self(h, route_input, bank, valid)[0]
