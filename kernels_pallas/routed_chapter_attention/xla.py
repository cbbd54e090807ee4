"""Routed chapter attention in plain XLA: what CPUs and shapes the kernels do not support run.

Gathering every (token, slot) chapter at once costs N·S·T·Hkv·dh elements (tens of GB at the 262k
shape), so tokens are flattened and cut into blocks of `block_tokens`; each block scans its slots and
gathers one slot's chapter K/V ([block, T, Hkv, dh]) at a time. "joint" merges slots with an online
softmax (running max, sum, accumulator); "moe" normalises each slot on its own and sums.

The backward is a custom VJP in the flash style: it keeps only the inputs, the output and the joint
log-sum-exp (O(N·H·dh)) and recomputes each slot's probabilities, where plain autodiff through the
scans would save per-slot carries (O(N·S·H·dh)). Chapter gradients are scatter-added into float32
[C, T, Hkv, dh] accumulators. Matmuls run in the input dtype with float32 accumulation; softmax and
all statistics are float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30  # log-sum-exp of a token whose slots are all empty (finite, so LSE merges stay NaN-free)
BLOCK_BYTES = 32 << 20  # default block: a float32 [block, T, Hkv, dh] slot gather/gradient stays <= this


def default_block_tokens(n, t, hkv, dh):
  """Largest power of two whose float32 [block, T, Hkv, dh] fits BLOCK_BYTES, at most n."""
  rows = max(1, BLOCK_BYTES // (4 * t * hkv * dh))
  return min(n, 1 << (rows.bit_length() - 1))


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, combine, *, block_tokens=None,
                             return_lse=False):
  """See `routed_chapter_attention.api` for the contract. Returns float32 [B, L, H, dh].

  return_lse (joint only): also return the float32 [B, L, H] log-sum-exp of the joint logits (NEG_INF for a
  token whose slots are all empty), differentiable, for callers that merge partial results across devices.
  """
  if combine not in ("joint", "moe"):
    raise ValueError(f"combine must be 'joint' or 'moe', got {combine!r}")
  if return_lse and combine != "joint":
    raise ValueError("return_lse is defined for combine='joint' only")
  n = q.shape[0] * q.shape[1]
  _, t, hkv, dh = k.shape
  if block_tokens is not None and block_tokens < 1:
    raise ValueError(f"block_tokens must be positive, got {block_tokens}")
  block = default_block_tokens(n, t, hkv, dh) if block_tokens is None else min(int(block_tokens), n)
  out, lse = _attention(q, k, v, ids, logit_scale, value_scale, combine, block)
  return (out, lse) if return_lse else out


def _blocks(x, block, fill):
  """[N, ...] -> [ceil(N / block), block, ...], the last block padded with `fill`."""
  pad = -x.shape[0] % block
  x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
  return x.reshape(-1, block, *x.shape[1:])


def _prepare(q, k, v, ids, logit_scale, value_scale, block):
  """Flattened, blocked operands: q [nblk, block, Hkv, G, dh]; ids/scales [nblk, block, S] (logit scale
  times 1/sqrt(dh)); padded tokens have empty slots. k, v in the common compute dtype."""
  b, l, h, dh = q.shape
  hkv, s = k.shape[2], ids.shape[-1]
  n = b * l
  cdt = jnp.result_type(q.dtype, k.dtype, v.dtype)
  qb = _blocks(q.reshape(n, hkv, h // hkv, dh).astype(cdt), block, 0)
  idb = _blocks(ids.reshape(n, s).astype(jnp.int32), block, -1)
  lsb = _blocks(logit_scale.reshape(n, s).astype(jnp.float32) / jnp.sqrt(jnp.float32(dh)), block, 0)
  vsb = _blocks(value_scale.reshape(n, s).astype(jnp.float32), block, 0)
  return qb, idb, lsb, vsb, k.astype(cdt), v.astype(cdt)


def _slot_major(*xs):
  """[block, S] -> [S, block], the layout lax.scan walks over slots."""
  return tuple(x.T for x in xs)


def _gather(x, chapter):
  """x[chapter] for every token of a block ([block, T, Hkv, dh]); empty slots read chapter 0 (masked later)."""
  return jnp.take(x, jnp.maximum(chapter, 0), axis=0, mode="clip")


def _scores(qb, kg, ls):
  """float32 [block, Hkv, G, T] dot products q.k and logits ls * q.k (ls already includes 1/sqrt(dh))."""
  raw = jnp.einsum("nkgd,ntkd->nkgt", qb, kg, preferred_element_type=jnp.float32)
  return raw, raw * ls[:, None, None, None]


def _forward(q, k, v, ids, logit_scale, value_scale, combine, block):
  b, l, h, dh = q.shape
  qb, idb, lsb, vsb, k, v = _prepare(q, k, v, ids, logit_scale, value_scale, block)
  hkv, g = qb.shape[2], qb.shape[3]

  def one_block(args):
    qb, idb, lsb, vsb = args
    nb = qb.shape[0]
    o0 = jnp.zeros((nb, hkv, g, dh), jnp.float32)
    stat0 = jnp.zeros((nb, hkv, g), jnp.float32)

    def slot(carry, xs):
      chapter, ls, vs = xs
      valid = (chapter >= 0)[:, None, None]
      vg = _gather(v, chapter)
      _, z = _scores(qb, _gather(k, chapter), ls)
      if combine == "joint":
        m, lsum, o = carry
        m_new = jnp.maximum(m, z.max(-1))
        p = jnp.exp(z - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("nkgt,ntkd->nkgd", p.astype(v.dtype), vg, preferred_element_type=jnp.float32)
        new = (m_new, alpha * lsum + p.sum(-1), alpha[..., None] * o + vs[:, None, None, None] * pv)
        return tuple(jnp.where(valid if x.ndim == 3 else valid[..., None], x, old)
                     for x, old in zip(new, carry)), None
      p = jnp.exp(z - z.max(-1, keepdims=True))
      pv = jnp.einsum("nkgt,ntkd->nkgd", p.astype(v.dtype), vg, preferred_element_type=jnp.float32)
      w = jnp.where(valid, vs[:, None, None] / p.sum(-1), 0.0)
      return carry + w[..., None] * pv, None

    xs = _slot_major(idb, lsb, vsb)
    if combine == "joint":
      (m, lsum, o), _ = lax.scan(slot, (jnp.full_like(stat0, -jnp.inf), stat0, o0), xs)
      seen = lsum > 0
      out = o / jnp.where(seen, lsum, 1.0)[..., None]
      lse = jnp.where(seen, m + jnp.log(jnp.where(seen, lsum, 1.0)), NEG_INF)
      return out, lse
    out, _ = lax.scan(slot, o0, xs)
    return out, None

  out, lse = lax.map(one_block, (qb, idb, lsb, vsb))
  n = b * l
  out = out.reshape(-1, h, dh)[:n].reshape(b, l, h, dh)
  return out, (None if lse is None else lse.reshape(-1, h)[:n].reshape(b, l, h))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, ids, logit_scale, value_scale, combine, block):
  return _forward(q, k, v, ids, logit_scale, value_scale, combine, block)


def _attention_fwd(q, k, v, ids, logit_scale, value_scale, combine, block):
  out, lse = _forward(q, k, v, ids, logit_scale, value_scale, combine, block)
  saved_out = out if combine == "joint" else None  # only the joint D = dout·out needs it
  return (out, lse), (q, k, v, ids, logit_scale, value_scale, saved_out, lse)


def _attention_bwd(combine, block, res, cts):
  """Per slot (p_t: probabilities of its T tokens, joint- or slot-normalised; ls includes 1/sqrt(dh)):
    dp_t = vs·dout·v_t;   dz_t = p_t (dp_t − D),  D = dout·out − d_lse (joint) or vs·dout·attn_slot (moe);
    dq += ls Σ_t dz_t k_t;   dk_t += ls dz_t q;   dv_t += vs p_t dout;
    d logit_scale = Σ_t dz_t q·k_t / sqrt(dh);   d value_scale = Σ_t p_t dout·v_t.
  dout is rounded to the compute dtype once, and D uses that rounded dout too, so dp_t − D cancels
  consistently in bfloat16.
  """
  q, k, v, ids, logit_scale, value_scale, out, lse = res
  dout, dlse = cts
  b, l, h, dh = q.shape
  c, t, hkv, _ = k.shape
  n, g, s = b * l, h // hkv, ids.shape[-1]
  qb, idb, lsb, vsb, kc, vc = _prepare(q, k, v, ids, logit_scale, value_scale, block)
  dout = dout.astype(kc.dtype)
  doutb = _blocks(dout.reshape(n, hkv, g, dh), block, 0)
  if combine == "joint":
    delta = jnp.sum(dout.astype(jnp.float32) * out, -1) - dlse.astype(jnp.float32)
    statb = _blocks(jnp.stack([lse, delta], -1).reshape(n, hkv, g, 2), block, 0)
  else:
    statb = None  # moe recomputes each slot's normaliser and D

  def one_block(carry, args):
    qb, idb, lsb, vsb, doutb, statb = args

    def slot(carry, xs):
      dq, dk, dv = carry
      chapter, ls, vs = xs
      valid = (chapter >= 0)[:, None, None, None]
      kg, vg = _gather(kc, chapter), _gather(vc, chapter)
      raw, z = _scores(qb, kg, ls)
      if combine == "joint":
        p = jnp.exp(jnp.where(valid, z - statb[..., 0:1], -jnp.inf))
      else:
        p = jnp.exp(z - z.max(-1, keepdims=True))
        p = jnp.where(valid, p / p.sum(-1, keepdims=True), 0.0)
      dp_raw = jnp.einsum("nkgd,ntkd->nkgt", doutb, vg, preferred_element_type=jnp.float32)
      attn_dout = jnp.sum(p * dp_raw, -1, keepdims=True)
      vs4 = vs[:, None, None, None]
      dz = p * (vs4 * dp_raw - (statb[..., 1:2] if combine == "joint" else vs4 * attn_dout))
      dls = jnp.sum(dz * raw, axis=(1, 2, 3))
      dzs = (dz * ls[:, None, None, None]).astype(kc.dtype)
      dq = dq + jnp.einsum("nkgt,ntkd->nkgd", dzs, kg, preferred_element_type=jnp.float32)
      target = jnp.maximum(chapter, 0)  # empty slots have p = 0, so they add exact zeros to chapter 0
      dk = dk.at[target].add(jnp.einsum("nkgt,nkgd->ntkd", dzs, qb, preferred_element_type=jnp.float32))
      dv = dv.at[target].add(
          vs4 * jnp.einsum("nkgt,nkgd->ntkd", p.astype(vc.dtype), doutb, preferred_element_type=jnp.float32))
      return (dq, dk, dv), (dls, jnp.sum(attn_dout, axis=(1, 2, 3)))

    dk, dv = carry
    (dq, dk, dv), (dls, dvs) = lax.scan(slot, (jnp.zeros(qb.shape, jnp.float32), dk, dv),
                                       _slot_major(idb, lsb, vsb))
    return (dk, dv), (dq, dls.T, dvs.T)

  zeros_kv = jnp.zeros((c, t, hkv, dh), jnp.float32)
  (dk, dv), (dq, dls, dvs) = lax.scan(one_block, (zeros_kv, zeros_kv), (qb, idb, lsb, vsb, doutb, statb))
  dq = dq.reshape(-1, h, dh)[:n].reshape(q.shape).astype(q.dtype)
  dls = (dls.reshape(-1, s)[:n] / jnp.sqrt(jnp.float32(dh))).reshape(ids.shape).astype(logit_scale.dtype)
  dvs = dvs.reshape(-1, s)[:n].reshape(ids.shape).astype(value_scale.dtype)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, dls, dvs


_attention.defvjp(_attention_fwd, _attention_bwd)
