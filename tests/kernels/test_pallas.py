"""Pallas routed chapter attention against the gathered reference, and its dispatch against float64 numpy.

TPU kernels run in interpret mode (plain and the TPU simulator with out-of-bounds and race checks), the
Triton-style GPU kernels in the generic interpreter; both are also lowered for their real targets
(Mosaic TPU; Triton for an abstract H100), which checks block legality without the hardware.
Inputs are drawn from fixed seeds (`helpers.seeds`); every failure message carries the seed.
Shapes are shared across tests so each (backend, combine, dtype) compiles once.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.routed_chapter_attention import api, dispatch, pallas, reference
from tests.kernels.helpers import (SEED, Dims, assert_close, call_args, draw_inputs, grads_named, out_and_grads, rel,
                                   seeds)

DIMS = Dims(b=2, l=8, h=4, hkv=2, dh=16, c=12, t=16, s=3)
B, L, H, HKV, DH, C, T, S = DIMS
BLOCK = {"tpu": 8, "gpu": 16}


def _ids(rng, pattern):
  """[B, L, S] routing. Every pattern has a token with all slots empty."""
  if pattern == "random":  # duplicates within a token, empty slots, ~4 pairs per chapter
    ids = rng.integers(-1, C, size=(B, L, S))
    ids[0, 1] = 4  # one chapter in every slot of a token
  elif pattern == "one_chapter":  # every pair on chapter 5: many consecutive tiles of one chapter
    ids = np.full((B, L, S), 5)
  elif pattern == "skewed":  # one multi-tile chapter, two small ones, the other 9 chapters unused
    ids = rng.choice([3, 3, 3, 3, 7, 10, -1], size=(B, L, S))
  else:
    raise ValueError(pattern)
  ids[0, 0] = -1
  return ids.astype(np.int32)


def _inputs(seed, pattern="random", dtype=np.float32):
  rng = np.random.default_rng(seed)
  return draw_inputs(rng, DIMS, _ids(rng, pattern), dtype=dtype)


@functools.cache
def _vjp(impl, combine, return_lse):
  """jit(inputs -> (outputs, cotangents of q, k, v, logit_scale, value_scale)); impl = (backend, block,
  interpret) or "reference" (which reads the inputs in float32). One compile per configuration, shared by
  every routing pattern."""
  def f(q, k, v, ids, ls, vs):
    if impl == "reference":
      q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
      return reference.routed_chapter_attention(q, k, v, ids, ls, vs, combine, return_lse=return_lse)
    backend, block, interpret = impl
    return pallas.routed_chapter_attention(q, k, v, ids, ls, vs, combine, backend=backend, block_pairs=block,
                                           interpret=interpret, return_lse=return_lse)

  return jax.jit(lambda x: out_and_grads(f, x, return_lse))


def _check(impl, combine, x, seed, tol, return_lse=False):
  out, grads = _vjp(impl, combine, return_lse)(x)
  ref_out, ref_grads = _vjp("reference", combine, return_lse)(x)
  if return_lse:  # compare the LSE of tokens with slots (-1e30 elsewhere would swamp the norm)
    has_slots = np.asarray(x["ids"]).max(-1) >= 0
    outs = [("out", out[0], ref_out[0]), ("lse", out[1][has_slots], ref_out[1][has_slots])]
  else:
    outs = [("out", out, ref_out)]
  assert_close([*outs, *grads_named(grads, ref_grads)], tol, f"{impl} {combine} seed={seed}")
  return out, grads


# ---------------------------------------------------------------------------------------------------
# Kernels vs the reference: forward and gradients.

@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("combine", ["joint", "moe"])
def test_matches_reference(backend, combine, seed):
  """GQA (H=4, Hkv=2), duplicate and empty slots, one chapter over many tiles, most chapters unused."""
  impl = (backend, BLOCK[backend], True)
  for pattern in ("random", "one_chapter", "skewed"):
    x = _inputs(seed, pattern)
    out, (_, dk, dv, _, _) = _check(impl, combine, x, f"{seed} {pattern}", 1e-5)
    unused = np.setdiff1d(np.arange(C), x["ids"])
    assert not np.any(np.asarray(dk)[unused]) and not np.any(np.asarray(dv)[unused]), f"{pattern} seed={seed}"
    assert not np.any(np.asarray(out)[0, 0]), f"a token without slots must get zeros (seed={seed})"


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("backend,combine", [("tpu", "joint"), ("gpu", "moe")])
def test_bfloat16(backend, combine, seed):
  _check((backend, 16, True), combine, _inputs(seed, "random", jnp.bfloat16), seed, 1e-2)


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_return_lse(backend, seed):
  """The joint LSE and its gradient (d_lse enters as D - d_lse) against the reference's."""
  (_, lse), _ = _check((backend, BLOCK[backend], True), "joint", _inputs(seed, "skewed"), seed, 1e-5,
                       return_lse=True)
  assert np.asarray(lse)[0, 0].max() <= -1e29, f"a token without slots has LSE -1e30 (seed={seed})"


def test_return_lse_needs_joint():
  with pytest.raises(ValueError, match="joint"):
    pallas.routed_chapter_attention(*call_args(_inputs(SEED)), "moe", return_lse=True)


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("combine", ["joint", pytest.param("moe", marks=pytest.mark.slow)])
def test_tpu_simulator_no_oob_no_races(combine, seed):
  """The TPU simulator raises on any out-of-bounds block read or data race, and fills uninitialised
  buffers with NaN, so a dK/dV block not zeroed on its chapter's first tile would show up."""
  params = pltpu.InterpretParams(out_of_bounds_reads="raise", detect_races=True, uninitialized_memory="nan")
  _check(("tpu", 8, params), combine, _inputs(seed, "skewed"), seed, 1e-5)


@pytest.mark.parametrize("seed", seeds())
def test_ids_checked_when_concrete_and_dropped_under_jit(seed):
  x = _inputs(seed)
  bad, dropped = x["ids"].copy(), x["ids"].copy()
  bad[1, 3, 0], dropped[1, 3, 0] = C, -1
  args = [x[n] for n in ("q", "k", "v")]
  with pytest.raises(ValueError, match="ids must lie"):
    pallas.routed_chapter_attention(*args, bad, x["logit_scale"], x["value_scale"], "joint")
  run = _vjp(("tpu", 8, True), "joint", False)  # compiled by test_matches_reference
  out, expected = run({**x, "ids": bad})[0], run({**x, "ids": dropped})[0]
  np.testing.assert_array_equal(out, expected, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", seeds())
def test_api_dispatches_to_pallas(seed):
  args = call_args(_inputs(seed))
  out = api.routed_chapter_attention(*args, combine="moe", implementation="pallas")
  err = rel(out, reference.routed_chapter_attention(*args, "moe"))
  assert err <= 1e-5, f"rel err {err:.2e} (seed={seed})"


@pytest.mark.parametrize("backend,block_pairs,t,dtype", [("tpu", 12, T, jnp.float32), ("tpu", 8, T, jnp.bfloat16),
                                                      ("gpu", 24, T, jnp.float32), ("gpu", 16, 24, jnp.float32)])
def test_illegal_blocks_rejected(backend, block_pairs, t, dtype):
  q = jnp.zeros((B, L, H, DH), dtype)
  k = jnp.zeros((C, t, HKV, DH), dtype)
  ids = jnp.zeros((B, L, S), jnp.int32)
  scale = jnp.ones((B, L, S), jnp.float32)
  with pytest.raises(ValueError, match="block_pairs|T="):
    pallas.routed_chapter_attention(q, k, k, ids, scale, scale, "joint", backend=backend, block_pairs=block_pairs)


@pytest.mark.parametrize("backend,combine,dtype", [("tpu", "joint", jnp.float32), ("tpu", "moe", jnp.bfloat16),
                                                   ("gpu", "joint", jnp.bfloat16), ("gpu", "moe", jnp.float32)])
def test_lowers_for_hardware(backend, combine, dtype):
  """Forward and backward lower to Mosaic TPU / Triton (H100) custom calls: block shapes are legal."""
  x = _inputs(SEED, dtype=dtype)
  f = functools.partial(pallas.routed_chapter_attention, combine=combine, backend=backend, block_pairs=16,
                        interpret=False)
  run = jax.jit(lambda x: out_and_grads(f, x)[1])
  ctx = contextlib.nullcontext()
  if backend == "gpu":
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    ctx = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
  with ctx:
    text = run.trace(x).lower(lowering_platforms=("tpu" if backend == "tpu" else "cuda",)).as_text()
  kernels = text.count("@tpu_custom_call(") if backend == "tpu" else text.count("xla.gpu.triton(")
  assert kernels == (2 if backend == "tpu" else 3), text[:2000]


# ---------------------------------------------------------------------------------------------------
# dispatch alone, against float64 numpy.

plan_of = jax.jit(dispatch.make_plan, static_argnums=(1, 2))
merge = jax.jit(dispatch.merge, static_argnums=5)


def _random_ids(rng, n, s, c, kind):
  if kind == "uniform":
    return rng.integers(-1, c, size=(n, s))
  if kind == "worst":  # every used chapter ends one pair into a tile: the static bound is reached
    return np.concatenate([np.arange(c - 1), np.full(n * s - (c - 1), c - 1)]).reshape(n, s)
  return np.full((n, s), -1)


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("n,s,c,bp,kind", [(16, 3, 7, 4, "uniform"), (10, 2, 5, 4, "worst"), (9, 5, 40, 8, "uniform"),
                                           (6, 2, 3, 8, "empty"), (32, 4, 3, 8, "uniform")])
def test_plan_invariants(n, s, c, bp, kind, seed):
  ids = _random_ids(np.random.default_rng(seed), n, s, c, kind).astype(np.int32)
  plan = jax.tree.map(np.asarray, plan_of(jnp.asarray(ids), c, bp))
  p, msg = n * s, f"seed={seed}"
  tiles = dispatch.num_tiles_bound(p, c, bp)
  r = tiles * bp
  flat = ids.reshape(p)
  counts = np.bincount(flat[flat >= 0], minlength=c)
  used = int(np.sum(-(-counts // bp)))
  assert plan.tile_info.shape == (tiles,) and plan.row_pair.shape == (r,), msg
  run = int(plan.num_tiles)  # an all-empty batch still runs one all-padding tile
  assert run == max(used, 1) and used <= tiles, msg
  if kind == "worst":
    assert used == tiles, msg
  chapter, first = plan.tile_info >> 1, plan.tile_info & 1
  # Tiles: one chapter each, ascending, a chapter's tiles consecutive, flagged first exactly at the start;
  # tiles past the run repeat the last chapter unflagged.
  assert np.all(np.diff(chapter[:run]) >= 0), msg
  np.testing.assert_array_equal(first[:run], np.r_[True, np.diff(chapter[:run]) > 0], err_msg=msg)
  assert not first[run:].any() and np.all(chapter[run:] == chapter[run - 1]), msg
  np.testing.assert_array_equal(np.bincount(chapter[:used], minlength=c), -(-counts // bp), err_msg=msg)
  rows = plan.row_pair.reshape(tiles, bp)
  real = rows < p
  assert np.all(flat[np.where(real, rows, 0)][real] == np.repeat(chapter, bp).reshape(tiles, bp)[real]), msg
  # Rows: each non-empty pair exactly once, stable order within a chapter, padding only after a chapter's pairs.
  assert sorted(plan.row_pair[plan.row_pair < p]) == list(np.flatnonzero(flat >= 0)), msg
  for ch in range(c):
    mine = plan.row_pair[np.repeat(chapter == ch, bp) & (np.arange(r) < used * bp)]
    k = counts[ch]
    assert np.all(np.diff(mine[:k]) > 0) and np.all(mine[k:] == p), msg
  np.testing.assert_array_equal(plan.pair_row < r, flat >= 0, err_msg=msg)
  valid = flat >= 0
  np.testing.assert_array_equal(plan.row_pair[plan.pair_row[valid]], np.flatnonzero(valid), err_msg=msg)
  # Runs (GPU dK/dV): the used chapters ascending, each with its tile range.
  uniq = np.flatnonzero(counts)
  u = min(c, p)
  np.testing.assert_array_equal(plan.run_chapter, np.r_[uniq, np.full(u - len(uniq), c)], err_msg=msg)
  for ch, lo, hi in zip(plan.run_chapter[:len(uniq)], plan.run_start, plan.run_stop):
    np.testing.assert_array_equal(np.flatnonzero(chapter[:used] == ch), np.arange(lo, hi), err_msg=msg)
  # Round trip pairs -> rows -> pairs.
  x = np.random.default_rng(seed).normal(size=p).astype(np.float32)
  back = dispatch.rows_to_pairs(dispatch.pairs_to_rows(jnp.asarray(x), plan), plan)
  np.testing.assert_array_equal(back, np.where(valid, x, 0), err_msg=msg)


@pytest.mark.parametrize("seed", seeds())
def test_kv_fetched_once_per_chapter_run(seed):
  """The TPU K/V block index over the executed grid (Hkv outer, tiles inner) changes exactly once per
  chapter in use per kv head, so each used chapter's block is fetched once per run of its tiles."""
  rng = np.random.default_rng(seed)
  for pattern in ("random", "one_chapter", "skewed"):
    ids = _ids(rng, pattern).reshape(B * L, S)
    plan = plan_of(jnp.asarray(ids), C, 8)
    blocks = [(int(info) >> 1, j) for j in range(HKV) for info in np.asarray(plan.tile_info)[:int(plan.num_tiles)]]
    fetches = 1 + sum(a != b for a, b in zip(blocks, blocks[1:]))
    assert fetches == HKV * len(np.unique(ids[ids >= 0])), f"{pattern} seed={seed}"


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("combine", ["joint", "moe"])
def test_merge_float64(combine, seed):
  rng = np.random.default_rng(seed)
  n, s, c, bp, h, dh = 12, 4, 5, 4, 3, 8
  ids = rng.integers(-1, c, size=(n, s)).astype(np.int32)
  ids[2] = -1
  plan = plan_of(jnp.asarray(ids), c, bp)
  o_pair, lse_pair = rng.normal(size=(h, n * s, dh)), rng.normal(size=(h, n * s)) * 3
  vs = rng.uniform(0.1, 1, size=(n, s))
  o_rows = dispatch.pairs_to_rows(jnp.asarray(o_pair.transpose(1, 0, 2), jnp.float32), plan).transpose(1, 0, 2)
  lse_rows = dispatch.pairs_to_rows(jnp.asarray(lse_pair.T, jnp.float32), plan).T
  out, lse = merge(o_rows, lse_rows, plan, jnp.asarray(ids >= 0), jnp.asarray(vs, jnp.float32), combine)
  valid = (ids >= 0).reshape(n * s)
  o64 = np.where(valid[None, :, None], o_pair, 0).reshape(h, n, s, dh)
  w = np.where(ids >= 0, vs, 0)[None]
  if combine == "joint":
    l64 = np.where(valid[None], lse_pair, -np.inf).reshape(h, n, s)
    with np.errstate(divide="ignore"):
      tot = np.log(np.exp(l64).sum(-1))
    w = w * np.exp(l64 - np.where(np.isfinite(tot), tot, 0)[..., None])
    np.testing.assert_allclose(np.asarray(lse)[:, ids.max(1) >= 0], tot[:, ids.max(1) >= 0], rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(lse)[:, 2] <= -1e29), f"seed={seed}"
  expected = np.einsum("hns,hnsd->hnd", w, o64)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6, err_msg=f"seed={seed}")
  assert not np.any(np.asarray(out)[:, 2]), f"seed={seed}"
