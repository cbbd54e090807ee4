"""The XLA routed chapter attention against the gathered reference (outputs and gradients), the joint
log-sum-exp against float64 numpy, the reference itself (output and log-sum-exp) against float64 numpy,
and a compiled-memory check that nothing of the gathered size N·S·T·Hkv·dh is ever allocated. Inputs are
drawn from fixed seeds (`helpers.seeds`); the seed is in every assertion message."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.routed_chapter_attention import api, reference, xla
from tests.kernels.helpers import (DIFF_ARGS, Dims, assert_close, call_args, draw_inputs, grads_named, out_and_grads,
                                   rel, seeds)


def _ids(rng, dims, pattern):
  """random: any chapter, ~20% empty slots, token (0, 0) all empty; duplicates: 3 chapters for >3 slots;
  one_chapter: every slot of every token on one chapter; unused: 3 chapters of many, some empty slots."""
  b, l, s, c = dims.b, dims.l, dims.s, dims.c
  if pattern == "one_chapter":
    return np.full((b, l, s), rng.integers(c), np.int32)
  if pattern == "duplicates":
    ids = rng.integers(0, 3, (b, l, s))
  elif pattern == "unused":
    ids = rng.choice(rng.choice(c, 3, replace=False), (b, l, s))
  else:
    ids = rng.integers(0, c, (b, l, s))
  ids = np.where(rng.random((b, l, s)) < 0.2, -1, ids)
  ids[0, 0] = -1
  return ids.astype(np.int32)


def _inputs(seed, dims, pattern, dtype=np.float32):
  """Scales in [0.2, 2], some logit scales exactly 0."""
  rng = np.random.default_rng(seed)
  return draw_inputs(rng, dims, _ids(rng, dims, pattern), dtype=dtype, logit_scale=(0.2, 2.0),
                     value_scale=(0.2, 2.0), zero_logit_scale=0.1)


@functools.partial(jax.jit, static_argnames=("impl", "combine", "block"))
def _out_and_grads(x, *, impl, combine, block=(None, None)):
  if impl == "xla":
    f = functools.partial(xla.routed_chapter_attention, combine=combine, block_pairs=block[0], chunk_tiles=block[1])
  else:
    f = functools.partial(reference.routed_chapter_attention, combine=combine)
  return out_and_grads(f, x)


@functools.partial(jax.jit, static_argnames=("block",))
def _lse_out_and_grads(x, *, block):
  f = functools.partial(xla.routed_chapter_attention, combine="joint", block_pairs=block[0], chunk_tiles=block[1],
                        return_lse=True)
  (out, lse), grads = out_and_grads(f, x, return_lse=True)
  return out, lse, grads


def _numpy64(q, k, v, ids, logit_scale, value_scale, combine):
  """Gathered float64 attention: output [B,L,H,dh], joint log-sum-exp [B,L,H] (-inf if all empty), the
  probabilities [B,L,Hkv,G,S,T], and the gathered pieces the lse gradient needs."""
  q, k, v, ls, vs = (np.asarray(x, np.float64) for x in (q, k, v, logit_scale, value_scale))
  b, l, h, dh = q.shape
  hkv = k.shape[2]
  valid = (ids >= 0)[:, :, None, None, :, None]
  kg, vg = k[np.maximum(ids, 0)], v[np.maximum(ids, 0)]
  qg = q.reshape(b, l, hkv, h // hkv, dh)
  raw = np.einsum("blkgd,blstkd->blkgst", qg, kg) / math.sqrt(dh)
  z = np.where(valid, raw * ls[:, :, None, None, :, None], -np.inf)
  axes = (-2, -1) if combine == "joint" else (-1,)
  m = z.max(axis=axes, keepdims=True)
  e = np.exp(z - np.where(np.isfinite(m), m, 0.0))
  den = e.sum(axis=axes, keepdims=True)
  p = e / np.where(den > 0, den, 1.0)
  w = np.where(valid, vs[:, :, None, None, :, None], 0.0)
  out = np.einsum("blkgst,blstkd->blkgd", p * w, vg).reshape(b, l, h, dh)
  with np.errstate(divide="ignore"):
    lse = (m + np.log(den)).reshape(b, l, h) if combine == "joint" else None
  return out, lse, p, dict(qg=qg, kg=kg, raw=raw, ls=ls)


def _numpy64_lse_grads(ids, c, p, qg, kg, raw, ls, g_lse):
  """d(Σ g_lse·lse) for q, k, logit_scale: dz = g_lse·p, z = ls·q·k/sqrt(dh)."""
  b, l, hkv, grp, s, t = p.shape
  dh = qg.shape[-1]
  dz = g_lse.reshape(b, l, hkv, grp)[..., None, None] * p
  dzs = dz * ls[:, :, None, None, :, None] / math.sqrt(dh)
  dq = np.einsum("blkgst,blstkd->blkgd", dzs, kg).reshape(b, l, hkv * grp, dh)
  dk = np.zeros((c,) + kg.shape[3:])
  valid = ids >= 0
  np.add.at(dk, ids[valid], np.einsum("blkgst,blkgd->blstkd", dzs, qg)[valid])
  dls = np.einsum("blkgst,blkgst->bls", dz, raw)
  return dq, dk, dls


SHAPES = {  # name: (dims, (block_pairs, chunk_tiles)); many chunks, the last one padded
    "gqa": (Dims(b=2, l=9, h=4, hkv=2, dh=8, c=40, t=5, s=4), (4, 5)),    # 48 tiles in 10 chunks
    "mha": (Dims(b=1, l=13, h=3, hkv=3, dh=16, c=40, t=7, s=5), (8, 2)),  # 43 tiles in 22 chunks
}
GQA = SHAPES["gqa"][0]
PATTERNS = ("random", "duplicates", "one_chapter", "unused")


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("combine", ["joint", "moe"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_xla_matches_reference_float32(shape, combine, seed):
  """Each id pattern reuses the shape's compiled programs (ids are data)."""
  dims, block = SHAPES[shape]
  for pattern in PATTERNS:
    x = _inputs(seed, dims, pattern)
    ids = x["ids"]
    out, grads = _out_and_grads(x, impl="xla", combine=combine, block=block)
    ref_out, ref_grads = _out_and_grads(x, impl="reference", combine=combine)
    msg = f"shape={shape} combine={combine} ids={pattern} seed={seed}"
    assert out.dtype == jnp.float32 and out.shape == x["q"].shape, msg
    for name, a, r in grads_named(grads, ref_grads):
      assert a.dtype == r.dtype and bool(jnp.all(jnp.isfinite(a))), f"{name} {msg}"
    assert_close([("output", out, ref_out), *grads_named(grads, ref_grads)], 1e-5, msg)
    empty = np.all(ids < 0, axis=-1)
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(grads[0])[empty] == 0), msg
    unread = np.setdiff1d(np.arange(x["k"].shape[0]), ids[ids >= 0])
    assert np.all(np.asarray(grads[1])[unread] == 0) and np.all(np.asarray(grads[2])[unread] == 0), msg


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("combine", ["joint", "moe"])
def test_xla_bfloat16_within_1e2_of_float32_reference(combine, seed):
  """With the default tile and chunk sizes (one chunk here). The reference reads the same bfloat16
  values in float32."""
  x = _inputs(seed, GQA, "random", jnp.bfloat16)
  out, grads = _out_and_grads(x, impl="xla", combine=combine)
  ref_out, ref_grads = _out_and_grads({**x, **{n: x[n].astype(np.float32) for n in ("q", "k", "v")}},
                                      impl="reference", combine=combine)
  msg = f"combine={combine} seed={seed}"
  assert out.dtype == jnp.float32 and rel(out, ref_out) <= 1e-2, f"output rel err {rel(out, ref_out):.2e} {msg}"
  for name, a in zip(DIFF_ARGS, grads):
    assert a.dtype == (jnp.bfloat16 if name in ("q", "k", "v") else jnp.float32), f"d{name} dtype {a.dtype} {msg}"
  assert_close(grads_named(grads, ref_grads), 1e-2, msg)


@pytest.mark.parametrize("seed", seeds())
def test_xla_lse_value_and_gradient_match_numpy64(seed):
  dims, block = SHAPES["gqa"]
  x = _inputs(seed, dims, "random")
  out, lse, grads = _lse_out_and_grads(x, block=block)
  _, ref_grads = _out_and_grads(x, impl="reference", combine="joint")
  out64, lse64, p, parts = _numpy64(*call_args(x), "joint")
  dq, dk, dls = _numpy64_lse_grads(x["ids"], dims.c, p, g_lse=x["ct_lse"], **parts)
  msg = f"seed={seed}"
  empty = np.all(x["ids"] < 0, axis=-1)
  assert lse.dtype == jnp.float32 and np.all(np.asarray(lse)[empty] <= -1e29), msg
  assert rel(np.asarray(lse)[~empty], lse64[~empty]) <= 1e-6, f"lse rel err {msg}"
  assert rel(out, out64) <= 1e-5, f"output rel err {msg}"
  expected = [ref_grads[0] + dq, ref_grads[1] + dk, ref_grads[2], ref_grads[3] + dls, ref_grads[4]]
  assert_close(grads_named(grads, expected), 1e-5, msg)
  with pytest.raises(ValueError, match="joint"):
    xla.routed_chapter_attention(*call_args(x), "moe", return_lse=True)
  for name in ("block_pairs", "chunk_tiles"):
    with pytest.raises(ValueError, match=name):
      xla.routed_chapter_attention(*call_args(x), "joint", **{name: 0})


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("combine", ["joint", "moe"])
def test_reference_matches_numpy64(combine, seed):
  """The oracle itself, and (joint) its log-sum-exp, which the Pallas tests compare against."""
  x = _inputs(seed, GQA, "random")
  out, _ = _out_and_grads(x, impl="reference", combine=combine)
  out64, lse64 = _numpy64(*call_args(x), combine)[:2]
  assert rel(out, out64) <= 1e-5, f"combine={combine} seed={seed}"
  if combine == "joint":
    _, lse = jax.jit(reference.routed_chapter_attention, static_argnums=(6, 7))(*call_args(x), combine, True)
    empty = np.all(x["ids"] < 0, axis=-1)
    assert np.all(np.asarray(lse)[empty] <= -1e29), f"seed={seed}"
    assert rel(np.asarray(lse)[~empty], lse64[~empty]) <= 1e-6, f"lse rel err seed={seed}"


@pytest.mark.parametrize("seed", seeds())
def test_api_auto_on_cpu_runs_xla(seed):
  assert api.resolve("auto") == "xla"
  x = _inputs(seed, GQA, "random")
  got = jax.jit(functools.partial(api.routed_chapter_attention, combine="moe", implementation="auto"))(*call_args(x))
  want, _ = _out_and_grads(x, impl="reference", combine="moe")
  assert rel(got, want) <= 1e-5, f"seed={seed}"


def _largest_array(hlo_text):
  """Element count of the largest array shape named anywhere in an HLO module's text."""
  dims = re.findall(r"\b(?:pred|[suf]\d+|bf16)\[([\d,]*)\]", hlo_text)
  return max(math.prod(int(d) for d in ds.split(",") if d) for ds in dims)


def _compiled(fn, args):
  """(temp bytes, largest array's element count) of jit(fn) compiled for `args`."""
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes, _largest_array(compiled.as_text())


def test_xla_never_allocates_gathered_keys():
  """At a shape where the gathered N·S·T·Hkv·dh dwarfs everything else, the compiled forward and
  forward+backward hold no array that large and a fraction of its bytes in scratch; the reference's
  forward (the check's own sanity test) holds both."""
  b, l, h, hkv, dh, c, t, s = 2, 128, 4, 2, 16, 64, 32, 32
  gathered = b * l * s * t * hkv * dh  # elements; float32 bytes are 4x
  sd = jax.ShapeDtypeStruct
  args = (sd((b, l, h, dh), jnp.float32), sd((c, t, hkv, dh), jnp.float32), sd((c, t, hkv, dh), jnp.float32),
          sd((b, l, s), jnp.int32), sd((b, l, s), jnp.float32), sd((b, l, s), jnp.float32))

  def loss(f, combine):
    return lambda q, k, v, ids, ls, vs: jnp.sum(f(q, k, v, ids, ls, vs, combine))

  for combine in ("joint", "moe"):
    fwd = loss(xla.routed_chapter_attention, combine)
    for fn in (fwd, jax.value_and_grad(fwd, argnums=(0, 1, 2, 4, 5))):
      temp, largest = _compiled(fn, args)
      assert largest < gathered and temp < gathered, (combine, largest, temp, gathered)
  temp, largest = _compiled(loss(reference.routed_chapter_attention, "joint"), args)
  assert largest >= gathered and temp >= 4 * gathered, ("reference", largest, temp, gathered)


def test_default_chunk_keeps_row_buffers_cache_sized():
  """A chunk's float32 [tiles, H, block_pairs, max(T, dh)] buffer fits CHUNK_BYTES (at least one tile):
  `tiny` (H=4, T=dh=16) and the 262k shape (H=12, T=dh=64) at the default 32 rows per tile."""
  bp = xla.DEFAULT_BLOCK_PAIRS
  for h, t, dh, expected in ((4, 16, 16, 64), (12, 64, 64, 5)):
    tiles = xla.default_chunk_tiles(h, bp, t, dh)
    assert tiles == expected and tiles * h * bp * max(t, dh) * 4 <= xla.CHUNK_BYTES
  assert xla.default_chunk_tiles(64, 128, 512, 512) == 1
  # a call with fewer tiles (a decode step: 2 rows x 9 slots at tiny) runs no chunk of padding tiles
  assert xla.chunk_tiles_for(9, 4, bp, 16, 16) == 9 and xla.chunk_tiles_for(9, 4, bp, 16, 16, requested=4) == 4
