"""What the kernel tests share: fixed seeds, input draws, the output and gradients of an implementation,
and the relative-error comparison.

Seeds are fixed so that a failure reproduces on the next run; `seeds()` puts one seed in the default
suite and a sweep over more behind @slow, where a draw the fixed seed happens to miss can still show up.
"""
from typing import NamedTuple

import jax
import numpy as np
import pytest

SEED = 0
SWEEP_SEEDS = (1, 2, 3, 4)
CALL_ARGS = ("q", "k", "v", "ids", "logit_scale", "value_scale")  # the contract's positional order
DIFF_ARGS = ("q", "k", "v", "logit_scale", "value_scale")  # the differentiable ones, in that order


def seeds():
  """Values for a `seed` parameter: SEED in the default suite, SWEEP_SEEDS marked slow."""
  return [SEED, *(pytest.param(s, marks=pytest.mark.slow) for s in SWEEP_SEEDS)]


class Dims(NamedTuple):
  """q [b, l, h, dh]; k, v [c, t, hkv, dh]; ids and scales [b, l, s]."""
  b: int
  l: int
  h: int
  hkv: int
  dh: int
  c: int
  t: int
  s: int


def draw_inputs(rng, dims, ids, *, dtype=np.float32, logit_scale=(0.5, 1.5), value_scale=(0.1, 1.0),
                zero_logit_scale=0.0):
  """Host arrays: normal q, k, v in `dtype`, the given ids, uniform float32 scales in the given ranges
  (a `zero_logit_scale` fraction of logit scales exactly 0) and normal float32 cotangents ct (of the
  output) and ct_lse (of the joint log-sum-exp)."""
  b, l, h, hkv, dh, c, t, s = dims
  def normal(shape, dt=dtype):
    return rng.normal(size=shape).astype(dt)

  ls = rng.uniform(*logit_scale, (b, l, s)) * (rng.random((b, l, s)) >= zero_logit_scale)
  return {"q": normal((b, l, h, dh)), "k": normal((c, t, hkv, dh)), "v": normal((c, t, hkv, dh)),
          "ids": np.asarray(ids, np.int32), "logit_scale": ls.astype(np.float32),
          "value_scale": rng.uniform(*value_scale, (b, l, s)).astype(np.float32),
          "ct": normal((b, l, h, dh), np.float32), "ct_lse": normal((b, l, h), np.float32)}


def call_args(x):
  """x's arrays in the order routed_chapter_attention takes them."""
  return [x[n] for n in CALL_ARGS]


def out_and_grads(f, x, return_lse=False):
  """f(q, k, v, ids, logit_scale, value_scale) at x and the cotangents of DIFF_ARGS pulled back from
  x["ct"] (and x["ct_lse"] when f also returns the log-sum-exp). Trace it under jit."""
  out, pullback = jax.vjp(lambda q, k, v, ls, vs: f(q, k, v, x["ids"], ls, vs), *(x[n] for n in DIFF_ARGS))
  return out, pullback((x["ct"], x["ct_lse"]) if return_lse else x["ct"])


def grads_named(grads, ref_grads):
  """(name, got, want) per gradient of DIFF_ARGS, for `assert_close`."""
  return [("d" + n, a, b) for n, a, b in zip(DIFF_ARGS, grads, ref_grads)]


def rel(a, b):
  """Relative error ||a - b|| / ||b|| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_close(named, tol, msg):
  """Every (name, got, want) of `named` within relative error `tol`; msg ends each failure message."""
  for name, got, want in named:
    err = rel(got, want)
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol} ({msg})"
