"""Backbone building blocks: RMSNorm, RoPE, attention core, GQA self-attention, the MLP, tied embedding.

Numerics policy (as MoC-PT trains under bf16 autocast): parameters and the residual stream are float32;
matmul inputs are cast to `compute_dtype`; norms, softmax and the loss run in float32.
Model code names logical axes only; the mesh mapping lives in the config's rules table.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.routed_chapter_attention.contract import target_platform

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform (not NaN) softmax


def param_init(std: float, *names: str):
  """Normal(0, std) initialiser carrying logical axis names (sharding applied at the jit boundary)."""
  init = nnx.initializers.zeros_init() if std == 0 else nnx.initializers.normal(std)
  return nnx.with_partitioning(init, names, eager_sharding=False)


def matrix_dot_general(x, kernel, dimension_numbers, **kwargs):
  """`lax.dot_general` for a Linear's `x [..., in] @ kernel [in, out]`, run as one 2-D matmul over the
  flattened leading axes. Same product; the reason is the backward pass: the kernel's gradient of a 3-D
  contraction reaches XLA as a transposed dot whose operands XLA's CPU backend copies into a transposed
  layout, while the 2-D form's gradient is a plain [in, N] @ [N, out] product
  (docs/results/2026-11-27-cpu-step-speed.md)."""
  (((contract,), _), _) = dimension_numbers
  if x.ndim <= 2 or contract != x.ndim - 1:
    return jax.lax.dot_general(x, kernel, dimension_numbers, **kwargs)
  flat = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), kernel, (((1,), (0,)), ((), ())), **kwargs)
  return flat.reshape(*x.shape[:-1], flat.shape[-1])


def dense(din, dout, std, names, cfg_dtype, rngs, bias=False):
  """Bias-free (unless asked) Linear: float32 kernel [in, out], matmul in the compute dtype."""
  return nnx.Linear(din, dout, use_bias=bias, dtype=cfg_dtype, param_dtype=jnp.float32,
                    dot_general=matrix_dot_general,
                    kernel_init=param_init(std, *names),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), names[-1:],
                                                    eager_sharding=False),
                    rngs=rngs)


def rms_normalize(x, eps):
  """x / sqrt(mean(x^2) + eps) in float32: the one RMS routine (learnable gain applied by callers)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def normalize_tokens(x, kind, eps):
  """Parameter-free normalisation over the last axis, in float32: `rms`, `layernorm` or `none` (MoC-PT's
  preprocessing of the selected memory tokens; the product keys' optional query norm)."""
  if kind == "rms":
    return rms_normalize(x, eps)
  if kind == "layernorm":
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True) + eps)
  return x


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",), eager_sharding=False)

  def __call__(self, x):
    return rms_normalize(x, self.eps) * self.scale[...]


def rope(x, positions, theta):
  """Rotate-half (NeoX/Llama) RoPE on [B, L, H, D]; cos/sin cast to x's dtype as MoC-PT does."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def cpu_layouts() -> bool:
  """Whether the code being traced runs on a CPU, whose XLA backend wants other layouts than an accelerator's
  compiler (`attention` here, the unrolled layer scan in model/transformer.py). The platform is the active mesh's
  devices' (`kernels_pallas` contract): `compile_report --topology` traces for a TPU on a CPU host."""
  return target_platform() == "cpu"


def attention(q, k, v, mask=None):
  """Softmax attention with GQA: q [B,Lq,H,D], k/v [B,Lk,Hkv,D], mask broadcastable to [B,1,Lq,Lk] -> [B,Lq,H*D].

  Query head h reads kv head h // (H/Hkv) (MoC-PT's repeat_interleave grouping). Scores and softmax
  are float32; the value product runs in v's dtype. Two formulations of the same values, by platform: on a CPU
  `attention_heads_major` (the faster there), elsewhere `attention_token_major`, with which the TPU
  compiler holds the 262k model's evaluation step on v5e in 13.4 GiB a device where the other needs 19.5
  (docs/results/2026-11-27-cpu-step-speed.md).
  """
  return (attention_heads_major if cpu_layouts() else attention_token_major)(q, k, v, mask)


def attention_token_major(q, k, v, mask=None):
  """`attention` contracting the token-major layout: scores [B, Hkv, G, Lq, Lk], softmax, then the value product."""
  b, lq, h, d = q.shape
  hkv = k.shape[2]
  q = q.reshape(b, lq, hkv, h // hkv, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask[:, :, None], scores, NEG_INF)  # mask [B,1,Lq,Lk] -> [B,1,1,Lq,Lk]
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, lq, h * d)


def attention_heads_major(q, k, v, mask=None):
  """`attention` with the heads moved in front first ([B, Hkv, G*Lq, D] against [B, Hkv, Lk, D]): every product,
  forward and backward, is a plain batched matmul over the heads, the G query heads of a kv head stacked into one,
  which XLA's CPU backend runs without transposing the [.., Lq, Lk] weights; and the softmax's division comes after
  the value product, on [.., Lq, D] rather than [.., Lq, Lk]: fewer passes over the largest arrays of a CPU step."""
  b, lq, h, d = q.shape
  lk, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  q = q.reshape(b, lq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  scores = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
  if mask is not None:  # [B|1, 1, Lq, Lk] -> [B|1, 1, G*Lq, Lk], the G query heads' rows stacked
    mask = jnp.broadcast_to(mask[:, :, None], (mask.shape[0], 1, g, lq, lk)).reshape(mask.shape[0], 1, g * lq, lk)
    scores = jnp.where(mask, scores, NEG_INF)
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out / jnp.sum(weights, axis=-1, keepdims=True)
  return out.reshape(b, hkv, g, lq, d).transpose(0, 3, 1, 2, 4).reshape(b, lq, h * d)


class SelfAttention(nnx.Module):
  """Causal GQA self-attention with RoPE; bias-free projections. `output_projection=False` leaves W_o out: the
  heads' outputs come back concatenated, float32 [B, L, H*dh] (an hml memory block's queries, model/hml.py)."""

  def __init__(self, cfg, rngs, output_projection=True):
    m = cfg.model
    self.num_heads, self.num_kv_heads = m.num_heads, m.num_kv_heads
    self.head_dim = m.d_model // m.num_heads
    self.theta = m.rope_theta
    kv = self.num_kv_heads * self.head_dim
    dt = jnp.dtype(m.compute_dtype)
    self.q = dense(m.d_model, m.d_model, m.init_std, ("embed", "heads"), dt, rngs)
    self.k = dense(m.d_model, kv, m.init_std, ("embed", "kv"), dt, rngs)
    self.v = dense(m.d_model, kv, m.init_std, ("embed", "kv"), dt, rngs)
    self.o = (dense(m.d_model, m.d_model, m.attn_out_init_std, ("heads", "embed"), dt, rngs)
              if output_projection else None)

  def __call__(self, x, positions, mask):
    """x [B, L, d] -> [B, L, d]; `mask` [B|1, 1, L, L] says which positions each one attends to."""
    q, k, v = self._qkv(x, positions)
    return self._output(attention(q, k, v, mask), x.dtype)

  def decode(self, cache, x, positions, mask, index):
    """Cached decoding -> (cache, out). `cache` holds keys and values [B, M, Hkv, dh] of M slots; x's are
    written at slots [index, index+L) and x attends over all M slots (`mask` [B, 1, L, M] says which)."""
    q, k, v = self._qkv(x, positions)
    k, v = (jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1) for c, new in zip(cache, (k, v)))
    return (k, v), self._output(attention(q, k, v, mask), x.dtype)

  def _output(self, heads, dtype):
    """W_o of the heads' concatenated outputs [B, L, H*dh] (cast to `dtype`), or the heads themselves."""
    return heads if self.o is None else self.o(heads.astype(dtype))

  def _qkv(self, x, positions):
    b, l, _ = x.shape
    q = self.q(x).reshape(b, l, self.num_heads, self.head_dim)
    k = self.k(x).reshape(b, l, self.num_kv_heads, self.head_dim)
    v = self.v(x).reshape(b, l, self.num_kv_heads, self.head_dim)
    return rope(q, positions, self.theta), rope(k, positions, self.theta), v


# model.hidden_activation's plain MLPs: the activation between up and down (MoC-PT's: torch's gelu is the exact one)
PLAIN_ACTIVATIONS = {"silu": jax.nn.silu, "relu": jax.nn.relu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
                     "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh}


class MLP(nnx.Module):
  """SwiGLU (model.hidden_activation 'swiglu', the paper's: down(silu(gate x) * up x)) or a plain MLP (down(act(up
  x)), no gate). The plain ones are MoC-PT's other choices; Allen-Zhu & Li 2024 ("Physics of Language Models, Part
  3.3") find them storing more facts per parameter than a gated MLP over short training, which a study of capacity
  may want to use."""

  def __init__(self, cfg, rngs):
    m = cfg.model
    dt = jnp.dtype(m.compute_dtype)
    self.activation = m.hidden_activation
    if self.activation == "swiglu":
      self.gate = dense(m.d_model, m.mlp_dim, m.init_std, ("embed", "mlp"), dt, rngs)
    self.up = dense(m.d_model, m.mlp_dim, m.init_std, ("embed", "mlp"), dt, rngs)
    self.down = dense(m.mlp_dim, m.d_model, m.mlp_out_init_std, ("mlp", "embed"), dt, rngs)

  def __call__(self, x):
    if self.activation == "swiglu":
      return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
    return self.down(PLAIN_ACTIVATIONS[self.activation](self.up(x)))


class Embed(nnx.Module):
  """Token embedding tied to the LM head: lookup stays float32, the head matmul runs in compute dtype."""

  def __init__(self, cfg, rngs):
    m = cfg.model
    self.dtype = jnp.dtype(m.compute_dtype)
    self.embedding = nnx.Param(param_init(m.init_std, "vocab", "embed")(rngs.params(), (m.vocab_size, m.d_model)))

  def __call__(self, ids):
    return jnp.take(self.embedding[...], ids, axis=0)

  def attend(self, h):
    return jnp.einsum("bld,vd->blv", h.astype(self.dtype), self.embedding[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)
