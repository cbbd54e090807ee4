"""The routed chapter attention roofline against hand arithmetic.

The kernels' HBM traffic formulas are checked by enumerating the grid of a real tile plan
(`dispatch.make_plan` on random routing): a TPU block moves when its index differs from the previous grid
step's (inputs fetched, outputs written back), a GPU program loads what it reads. The xla variant's chunk
loops are checked against the jaxpr xla.py traces: its matmuls, and what crosses a chunk (scan inputs and
outputs, gathers from loop constants, scatter-adds into carries with their in-bounds rows counted on the
real plan). The expected tile count is checked against a Monte Carlo mean, the 262k figures against numbers
worked out by hand, and the CLI prints one finite JSON line. Routing is drawn from fixed seeds
(`helpers.seeds`); every message carries the seed.
"""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from kernels_pallas.routed_chapter_attention import dispatch, roofline, xla
from tests.kernels.helpers import seeds

N, SHARED, TOP_K, C, T, H, HKV, DH, BP = 48, 1, 2, 9, 16, 4, 2, 16, 8
G, S = H // HKV, SHARED + TOP_K
REPO = pathlib.Path(__file__).resolve().parents[2]  # the CLI runs from the source tree under test


def _uniform_ids(rng, n, m=1):
  """Shared chapters then `TOP_K` distinct routed ones per decision; `m` consecutive tokens share one."""
  decisions = -(-n // m)
  routed = np.stack([rng.choice(np.arange(SHARED, C), TOP_K, replace=False) for _ in range(decisions)])
  routed = np.repeat(routed, m, axis=0)[:n]
  return np.concatenate([np.tile(np.arange(SHARED), (n, 1)), routed], 1).astype(np.int32)


def _plan(ids, bp):
  plan = dispatch.make_plan(ids, C, bp)
  return (np.asarray(plan.tile_info), int(plan.num_tiles), np.asarray(plan.run_chapter),
          np.asarray(plan.run_start), np.asarray(plan.run_stop), plan.row_pair.shape[0])


def _shape(dtype_bytes, combine, bp=BP):
  return roofline.Shape(tokens=N, slots=S, shared=SHARED, chapters=C, chapter_tokens=T, heads=H, kv_heads=HKV,
                        head_dim=DH, block_pairs=bp, gpu_block_pairs=bp, dtype_bytes=dtype_bytes, combine=combine)


def _tpu_grid_bytes(info, run, specs):
  """specs: name -> (index(j, i), block bytes, is_output). Bytes moved over grid (HKV, run), tiles inner."""
  steps = [(j, i) for j in range(HKV) for i in range(run)]
  moved = dict.fromkeys(specs, 0)
  for name, (index, nbytes, is_output) in specs.items():
    idx = [index(j, i) for j, i in steps]
    if is_output:  # written back when the next step's block differs, and after the last step
      moved[name] = nbytes * (sum(a != b for a, b in zip(idx, idx[1:])) + 1)
    else:  # fetched for the first step and whenever the block changes
      moved[name] = nbytes * (1 + sum(a != b for a, b in zip(idx, idx[1:])))
  return moved


def _tpu_specs(info, b, backward, moe):
  """The BlockSpecs of pallas_tpu.forward / backward, written out by hand: (index, bytes, is output)."""
  chapter = lambda j, i: (info[i] >> 1, j)  # noqa: E731
  rows = lambda j, i: (j, i)  # noqa: E731
  col = lambda j, i: (i,)  # noqa: E731
  if not backward:
    return {"ls": (col, BP * 4, False), "q": (rows, G * BP * DH * b, False), "k": (chapter, T * DH * b, False),
            "v": (chapter, T * DH * b, False), "o": (rows, G * BP * DH * 4, True), "lse": (rows, G * BP * 4, True)}
  specs = {"ls": (col, BP * 4, False), "vs": (col, BP * 4, False), "q": (rows, G * BP * DH * b, False),
           "k": (chapter, T * DH * b, False), "v": (chapter, T * DH * b, False), "do": (rows, G * BP * DH * b, False),
           "lse": (rows, G * BP * 4, False), "dq": (rows, G * BP * DH * 4, True), "dls": (rows, BP * 4, True),
           "dvs": (rows, BP * 4, True), "dk": (chapter, T * DH * 4, True), "dv": (chapter, T * DH * 4, True)}
  if not moe:
    specs["d"] = (rows, G * BP * 4, False)
  return specs


def _gpu_program_bytes(run, runs, b, backward, moe):
  """Sum over the GPU programs of what each loads and stores (pallas_gpu's kernel bodies)."""
  stats = 1 if moe else 2
  per_tile_head = {"fwd": BP * 4 + BP * DH * b + 2 * T * DH * b + BP * DH * 4 + BP * 4,
                   "dq": 2 * BP * 4 + 2 * BP * DH * b + 2 * T * DH * b + stats * BP * 4 + BP * DH * 4 + 2 * BP * 4}
  if not backward:
    return H * run * per_tile_head["fwd"]
  total = H * run * per_tile_head["dq"]
  for chapter, start, stop in runs:  # dK/dV: program (kv head, chapter in use)
    if chapter >= C:
      continue
    for _ in range(HKV):
      total += 2 * T * DH * b + 2 * T * DH * 4  # its chapter's K, V in; dK, dV out, once
      total += (stop - start) * (2 * BP * 4 + G * (2 * BP * DH * b + stats * BP * 4))
  return total


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("dtype_bytes,combine,m", [(2, "joint", 1), (4, "moe", 1), (2, "joint", 4)])
def test_kernel_traffic_matches_grid_enumeration(dtype_bytes, combine, m, seed):
  ids = _uniform_ids(np.random.default_rng(seed), N, m)
  info, run, run_chapter, run_start, run_stop, rows = _plan(ids, BP)
  used = len(np.unique(ids))
  shape = _shape(dtype_bytes, combine)
  bound = dispatch.num_tiles_bound(N * S, C, BP)
  assert rows == bound * BP == roofline.plan_sizes(shape, BP).rows, f"seed={seed}"
  plan = roofline.Plan(BP, run, bound, rows, used)
  moe = combine == "moe"
  for backward in (False, True):
    moved = _tpu_grid_bytes(info, run, _tpu_specs(info, dtype_bytes, backward, moe))
    traffic, flops = roofline.pallas_tpu_kernel(shape, plan, backward)
    assert sum(traffic.values()) == sum(moved.values()), f"tpu backward={backward} {traffic} {moved} seed={seed}"
    assert traffic["kv"] == moved["k"] + moved["v"] == HKV * used * 2 * T * DH * dtype_bytes, f"seed={seed}"
    per_row_head = 4 * T * DH if not backward else (12 if moe else 10) * T * DH  # matmuls of one row, one head
    assert flops == run * BP * H * per_row_head, f"seed={seed}"
    traffic, _ = roofline.pallas_gpu_kernel(shape, plan, backward)
    runs = list(zip(run_chapter, run_start, run_stop))
    assert sum(traffic.values()) == _gpu_program_bytes(run, runs, dtype_bytes, backward, moe), f"gpu seed={seed}"


def _nbytes(var):
  return math.prod(var.aval.shape) * var.aval.dtype.itemsize


def _walk(jaxpr, kinds, times, scattered, total):
  """Adds to total the matmul FLOPs of `jaxpr` and the bytes crossing its scans' chunks. kinds: var ->
  "const" | "carry" | "xs" inside a scan body; scattered: accumulator rows -> rows updated in bounds over
  the whole scan. Any other use of a loop constant or carry fails: it would be traffic not modelled."""
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    uses = [kinds.get(v) for v in eqn.invars if isinstance(v, jcore.Var)]
    if name == "dot_general":  # counted, then its operands checked like any other op's
      (contract, _), _ = params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total["flops"] += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    if name == "scan":
      body, (consts, carry) = params["jaxpr"].jaxpr, (len(t.vals) for t in params["ft_in"].unpack()[:2])
      xs_ys = eqn.invars[consts + carry:] + eqn.outvars[carry:]
      total["bytes"] += times * sum(map(_nbytes, xs_ys))
      inner = dict(zip(body.invars, ["const"] * consts + ["carry"] * carry + ["xs"] * len(body.invars)))
      _walk(body, inner, times * params["length"], scattered, total)
    elif name == "gather" and uses[0] == "const":
      total["bytes"] += times * _nbytes(eqn.outvars[0])
    elif name == "scatter-add" and uses[0] == "carry":
      operand, _, updates = eqn.invars
      row = math.prod(updates.aval.shape[1:]) * updates.aval.dtype.itemsize
      total["bytes"] += 2 * scattered[operand.aval.shape[0]] * row  # read and write each row in bounds
    else:
      subs = [p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p for p in params.values()
              if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
      subs = [j for j in subs if len(j.invars) == len(eqn.invars)]
      if subs:
        inner = {i: kinds.get(o) for i, o in zip(subs[0].invars, eqn.invars) if isinstance(o, jcore.Var)}
        _walk(subs[0], inner, times, scattered, total)
      else:
        assert not {"const", "carry"} & set(uses), f"{name} reads a loop constant or carry: {eqn}"
  return total


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("dtype,combine,m", [(jnp.bfloat16, "joint", 1), (jnp.float32, "moe", 4)])
def test_xla_chunk_loops_match_the_traced_code(dtype, combine, m, seed):
  rng = np.random.default_rng(seed)
  ids = _uniform_ids(rng, N, m)
  chunk = 3  # 25 tiles in the bound: 9 chunks, 2 padding tiles
  shape = dataclasses.replace(_shape(jnp.dtype(dtype).itemsize, combine), xla_block_pairs=BP,
                              xla_chunk_tiles=chunk)
  plan = dispatch.make_plan(ids, C, BP)
  info, pair = np.asarray(plan.tile_info), np.asarray(plan.row_pair)
  tiles = -(-len(info) // chunk) * chunk
  token = np.full(tiles * BP, N)  # xla.py pads rows with token N (dropped) and tiles with chapter 0
  token[:len(pair)] = np.where(pair < N * S, pair // S, N)
  chapter = np.zeros(tiles, int)
  chapter[:len(info)] = info >> 1
  scattered = {N: int(np.sum(token < N)), C: int(np.sum(chapter < C))}

  args = [jnp.asarray(rng.normal(size=x), dtype) for x in ((1, N, H, DH), (C, T, HKV, DH), (C, T, HKV, DH))]
  args += [jnp.asarray(rng.uniform(0.5, 2, (1, N, S)), jnp.float32) for _ in range(2)]
  f = lambda q, k, v, ls, vs: xla.routed_chapter_attention(  # noqa: E731
      q, k, v, jnp.asarray(ids[None]), ls, vs, combine, block_pairs=BP, chunk_tiles=chunk)
  ct = jnp.ones((1, N, H, DH), jnp.float32)
  count = lambda g: _walk(jax.make_jaxpr(g)(*args).jaxpr, {}, 1, scattered, dict(flops=0, bytes=0))  # noqa: E731
  fwd, both = count(f), count(lambda *a: jax.vjp(f, *a)[1](ct))
  bwd = {key: both[key] - fwd[key] for key in fwd}

  v = roofline.analyse(shape)["variants"]["xla"]
  assert v["tiles_run"] == v["kv_fetches"] == tiles and v["chunk_tiles"] == chunk, f"seed={seed}"
  for key, walked, loops in (("forward", fwd, ("lse_pass", "output_pass")), ("backward", bwd, ("grad_pass",))):
    stages = v[key]["stages_per_token"]
    flops = N * sum(st["flops"] for name, st in stages.items() if not name.startswith("bank_"))
    nbytes = N * sum(stages[name]["bytes"] for name in loops if name in stages)
    assert flops == pytest.approx(walked["flops"], rel=1e-12), f"{key} FLOPs {flops} {walked} seed={seed}"
    assert nbytes == pytest.approx(walked["bytes"], rel=1e-12), f"{key} bytes {nbytes} {walked} seed={seed}"


@pytest.mark.parametrize("seed", seeds())
def test_expected_tiles_monte_carlo(seed):
  rng = np.random.default_rng(seed)
  for m in (1, 4):
    counts = np.array([[np.sum(-(-np.bincount(ids.ravel(), minlength=C) // BP)), len(np.unique(ids))]
                       for ids in (_uniform_ids(rng, N, m) for _ in range(1500))], float)
    tiles, used = roofline.expected_tiles(N, SHARED, TOP_K, C, BP, m)
    for name, exact, draws in (("tiles", tiles, counts[:, 0]), ("used", used, counts[:, 1])):
      se = draws.std() / math.sqrt(len(draws))
      assert abs(draws.mean() - exact) <= 5 * se + 1e-3, f"m={m} {name}: {draws.mean()} vs {exact} seed={seed}"
  # Every chapter read by every token: tiles are exact.
  assert roofline.expected_tiles(64, 3, 0, 3, 16) == (12.0, 3.0)
  assert roofline.expected_tiles(10, 0, 4, 4, 8) == (8.0, 4.0)


def test_262k_hand_arithmetic():
  r = roofline.analyse(roofline.Shape())
  n, p = 8192, 8192 * 65
  assert r["attention_flops_per_token_fwd"] == 4 * 65 * 64 * 12 * 64 == 12_779_520
  assert r["bank_projection_flops_per_token_fwd"] == 4 * 4097 * 64 * 768 * 768 / n
  tpu = r["variants"]["pallas_tpu"]
  assert tpu["plan"]["tiles_bound"] == (p + 4097 * 127) // 128 == 8224
  assert tpu["plan"]["rows"] == 8224 * 128
  assert tpu["kv_fetches"] == 12 * 4097 and tpu["kernel_bytes"]["forward"]["kv"] == 4097 * 2 * 64 * 768 * 2
  assert 6000 < tpu["plan"]["tiles"] < 6200  # 64 shared tiles + 4096 chapters of ~Binomial(8192, 1/64) pairs
  assert r["variants"]["pallas_gpu"]["dkv_serial_tiles"] == 8192 // 64 == 128
  naive = r["variants"]["naive"]["forward"]["stages_per_token"]
  assert naive["gather_kv"]["bytes"] == 65 * 2 * (2 * 64 * 768 * 2)  # read + write one chapter's K, V per slot
  assert r["variants"]["naive"]["largest_buffer_bytes"] == p * 2 * 64 * 768 * 2
  x = r["variants"]["xla"]  # 32 rows per tile, 5 tiles of [12 heads, 32 rows, 64] float32 per 512 KiB chunk
  assert x["chunk_tiles"] == 5 and x["plan"]["tiles_bound"] == (p + 4097 * 31) // 32 == 20608
  assert x["tiles_run"] == x["kv_fetches"] == 20610 and x["pairs_per_kv_fetch"] == p / 20610
  assert x["largest_buffer_bytes"] == 20610 * 32 * 12 * 2 * 4  # the backward's [LSE, D] rows
  out = x["forward"]["stages_per_token"]["output_pass"]
  assert out["flops"] == 4 * 20610 * 32 * 12 * 64 * 64 / n
  assert out["bytes"] == (4 * (20610 + 3 * 20610 * 32)  # chapters, tokens and both scales in
                          + 20610 * 32 * 12 * 4          # each row's token LSE in
                          + 20610 * 32 * 768 * 2         # q rows gathered
                          + 20610 * 2 * 64 * 768 * 2     # K, V gathered per tile
                          + 2 * p * 768 * 4) / n         # each pair's output added into its token's
  seq = r["variants"]["sequence"]["forward"]
  assert seq["flops_per_token"] == 4 * 65 * 64 * 12 * 64 + 4 * 65 * 64 * 768 * 768 / 1024
  for name, v in r["variants"].items():
    for pair in v["roofline"].values():
      fb, f = pair["forward_backward"], pair["forward"]
      assert 0 < f["ms"] < fb["ms"] and f["bound"] in ("compute", "memory"), name


def _finite(x):
  if isinstance(x, dict):
    return all(_finite(v) for v in x.values())
  if isinstance(x, list):
    return all(_finite(v) for v in x)
  return not isinstance(x, float) or math.isfinite(x)


def _cli(*args):
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "kernels_pallas.routed_chapter_attention.roofline", *args],
                        capture_output=True, text=True, check=True, env=env).stdout


def test_cli_prints_one_finite_json_line():
  out = _cli("--tokens", "1024").splitlines()
  assert len(out) == 1, out
  result = json.loads(out[0], parse_constant=lambda c: pytest.fail(f"non-finite {c}"))
  assert _finite(result) and set(result["variants"]) == set(roofline.VARIANTS)
  out = _cli("--table", "--stages", "pallas_tpu").splitlines()
  json.loads(out[0])
  assert out[1].startswith("| variant |") and any(line.startswith("| pallas_tpu stage |") for line in out)
