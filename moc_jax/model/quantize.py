"""Quantized memory bank for evaluation and serving: MoC-PT's per-row symmetric absmax int8 / int4.

A row is one memory token vector (dimension d). As MoC-PT's `QuantizedMemoryBank` (float32 arithmetic,
round half to even as `torch.round`):
* 8-bit: scale = max(absmax / 127, 1e-8), codes = clip(round(m / scale), -128, 127) as int8.
* 4-bit: scale = max(absmax / 7, 1e-8), codes = clip(round(m / scale), -8, 7), two per int8 byte: the low
  nibble holds the even index; unpacking sign-extends each nibble. d must be even.
* dequantised = float32(codes) * scale.
Storage per value: 1 byte (int8) or half a byte (int4), plus a float32 scale per row of d values.
Unlike MoC-PT, which dequantises the whole bank at every read, the model keeps the codes and
dequantises only the chapters a read takes (sequence routing); per-position routing dequantises what
it projects, the whole bank when every chapter may be named, inside that call only.

API:
  quantize_rows(x, bits) -> (codes int8 [..., d] (8) or [..., d/2] (4), scales float32 [...])
  dequantize_rows(codes, scales, bits) -> float32 [..., d]
  quantize_model(model, bits) -> model
      In place, after the parameters are restored; bits is 8 | 4 | "int8" | "int4". The bank parameter
      `model.bank.memory` is replaced by `model.bank.codes` / `model.bank.scales`, non-trainable
      `QuantizedBank` variables (not nnx.Param) with the bank's logical axes, so `nnx.split(model)`
      (all variables, not only nnx.Param) and `sharding.logical_shardings` shard them like the bank.
      Split the model again after the call: its graphdef changes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

_LEVELS = {8: 127, 4: 7}
_MIN_SCALE = 1e-8  # MoC-PT's clamp: an all-zero row (e.g. a padded chapter) gets codes 0, not 0/0
_BITS = {8: 8, 4: 4, "int8": 8, "int4": 4}


def _levels(bits):
  if bits not in _LEVELS:
    raise ValueError(f"bits={bits!r}: the bank quantizes to 8 or 4 bits")
  return _LEVELS[bits]


def quantize_rows(x, bits):
  """Per-row absmax codes and float32 scales of x [..., d] (module docstring)."""
  levels = _levels(bits)
  if bits == 4 and x.shape[-1] % 2:
    raise ValueError(f"int4 packs two codes per byte: the row dimension d={x.shape[-1]} must be even")
  x = jnp.asarray(x, jnp.float32)
  scales = jnp.maximum(_divide(jnp.max(jnp.abs(x), axis=-1), levels), _MIN_SCALE)
  codes = jnp.clip(jnp.round(_divide(x, scales[..., None])), -levels - 1, levels).astype(jnp.int8)
  if bits == 4:  # low nibble: even index, high nibble: odd index
    codes = (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)
  return codes, scales


def _divide(a, b):
  """a / b correctly rounded, as torch divides. XLA turns a division by a constant or a broadcast into
  a multiplication by its rounded reciprocal (an ulp off, which moves codes at rounding ties); a
  full-shaped divisor behind an optimization barrier is divided."""
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def unpack_rows(codes, bits):
  """int8 codes [..., d] of packed ones (4 bits: [..., d/2], nibbles sign-extended)."""
  _levels(bits)
  if bits == 8:
    return codes
  low, high = (codes << 4) >> 4, codes >> 4  # arithmetic shifts sign-extend each nibble
  return jnp.stack([low, high], axis=-1).reshape(codes.shape[:-1] + (2 * codes.shape[-1],))


def dequantize_rows(codes, scales, bits):
  """float32 [..., d] rows of `quantize_rows`' codes and scales."""
  return unpack_rows(codes, bits).astype(jnp.float32) * scales[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
  """A quantized bank (or part of one) as the memory layers read it: indexing and `take` act on the
  leading (bank, chapter, token) axes of codes and scales alike, so the reads that gather a float
  bank's chapters gather codes; `dequantize` makes floats of what was taken."""
  codes: jax.Array
  scales: jax.Array
  bits: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    """The float bank's shape."""
    return self.scales.shape + (self.codes.shape[-1] * 8 // self.bits,)

  def __getitem__(self, index):
    return QuantizedRows(self.codes[index], self.scales[index], self.bits)

  def take(self, ids, axis=0):
    return QuantizedRows(jnp.take(self.codes, ids, axis=axis), jnp.take(self.scales, ids, axis=axis), self.bits)


def dequantize(bank):
  """Float rows of a bank read: a `QuantizedRows` is dequantised, a float bank is returned as is."""
  if isinstance(bank, QuantizedRows):
    return dequantize_rows(bank.codes, bank.scales, bank.bits)
  return bank


class QuantizedBank(nnx.Variable):
  """Storage of a quantized bank: not an nnx.Param, so optimizers and parameter counts skip it."""


class QuantizedChapterBank(nnx.Module):
  """`ChapterBank` with codes [banks, chapters, T, d or d/2] and scales [banks, chapters, T]."""

  def __init__(self, memory: nnx.Param, bits: int):
    names = memory.get_metadata().get("out_sharding")
    codes, scales = _quantize_in_place(memory[...], bits)
    self.bits = bits
    self.codes = QuantizedBank(codes, out_sharding=names, eager_sharding=False)
    self.scales = QuantizedBank(scales, out_sharding=names and names[:-1], eager_sharding=False)

  def read(self):
    return QuantizedRows(self.codes[...], self.scales[...], self.bits)


def _quantize_in_place(bank, bits):
  """quantize_rows on the bank's devices: codes keep its sharding, scales drop the row dimension."""
  sharding = getattr(bank, "sharding", None)
  out = None
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (bank.ndim - len(sharding.spec))
    row_axes = spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],) if spec[-1] else ()
    split = math.prod(sharding.mesh.shape[a] for a in row_axes)
    if bits == 4 and (bank.shape[-1] // 2) % split:
      raise ValueError(f"int4 packs a row of d={bank.shape[-1]} into {bank.shape[-1] // 2} bytes, which the "
                       f"bank's {split}-way split of its rows (mesh axes {row_axes}) does not divide: use int8, "
                       "or a mesh whose `bank_embed` split divides d/2")
    out = (sharding, jax.sharding.NamedSharding(sharding.mesh, jax.P(*spec[:-1])))
  return jax.jit(quantize_rows, static_argnums=1, out_shardings=out)(bank, bits)


def quantize_model(model, bits):
  """Replaces `model.bank` by its quantized form (module docstring); returns the model."""
  if bits not in _BITS:
    raise ValueError(f"bits={bits!r}: use 8, 4, 'int8' or 'int4'")
  if getattr(model, "bank", None) is None:
    raise ValueError("the model has no memory bank to quantize")
  if isinstance(model.bank, QuantizedChapterBank):
    raise ValueError("the model's bank is already quantized")
  model.bank = QuantizedChapterBank(model.bank.memory, _BITS[bits])
  return model
