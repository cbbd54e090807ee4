"""Quantized bank (moc_jax.model.quantize): codes and round trip against a numpy restatement of MoC-PT's
QuantizedMemoryBank, the quantized model against the float model on the dequantised bank, what the
compiled sequence read holds, the loss change, and (8 fake devices, own process) sharded reads.

`python tests/model/test_quantize.py sharded SEED` is that process: one JSON line per mesh (int4 codes).
"""
import json
import os
import re
import subprocess
import sys
import types

if __name__ == "__main__":  # 8 fake devices, set before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                             " --xla_backend_optimization_level=0")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import moc_jax  # noqa: E402
from moc_jax import causality  # noqa: E402
from moc_jax.model import quantize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEVELS = {8: 127, 4: 7}


SEED = 0  # fixed: a failure reproduces; the error messages name it


# --- MoC-PT's formulas in numpy (float32 arithmetic, as torch on a float32 bank) ---------------------

def np_quantize(x, bits):
  levels = LEVELS[bits]
  x = np.asarray(x, np.float32)
  scales = np.maximum(np.abs(x).max(-1) / np.float32(levels), np.float32(1e-8))
  codes = np.clip(np.round(x / scales[..., None]), -levels - 1, levels).astype(np.int8)  # np.round: half to even
  if bits == 4:
    u = codes.astype(np.uint8)
    codes = ((u[..., 0::2] & 0x0F) | ((u[..., 1::2] & 0x0F) << 4)).astype(np.uint8).view(np.int8)
  return codes, scales


def np_dequantize(codes, scales, bits):
  if bits == 4:
    u = codes.view(np.uint8).astype(np.int16)
    low, high = u & 0x0F, u >> 4
    low, high = np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)
    codes = np.stack([low, high], -1).reshape(codes.shape[:-1] + (-1,))
  return codes.astype(np.float32) * scales[..., None]


quantize_rows = jax.jit(quantize.quantize_rows, static_argnums=1)
dequantize_rows = jax.jit(quantize.dequantize_rows, static_argnums=2)


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_and_round_trip_match_mocpt(bits):
  seed = SEED
  rng = np.random.default_rng(seed)
  x = (rng.standard_t(3, size=(3, 40, 64)) * rng.uniform(1e-3, 1.0, size=(3, 40, 1))).astype(np.float32)
  x[0, 0] = 0.0  # an all-zero row (padded chapters): MoC-PT's clamped scale, codes 0
  codes, scales = quantize_rows(x, bits)
  want_codes, want_scales = np_quantize(x, bits)
  assert codes.dtype == jnp.int8 and codes.shape == x.shape[:-1] + (64 * bits // 8,)
  np.testing.assert_array_equal(np.asarray(codes), want_codes, err_msg=f"seed {seed}")
  np.testing.assert_array_equal(np.asarray(scales), want_scales, err_msg=f"seed {seed}")
  back = np.asarray(dequantize_rows(codes, scales, bits))
  np.testing.assert_array_equal(back, np_dequantize(want_codes, want_scales, bits), err_msg=f"seed {seed}")
  assert not back[0, 0].any() and scales[0, 0] == np.float32(1e-8)
  # round-trip error vs float64 values: at most half a step (+ float32 rounding of the product)
  err = np.abs(back.astype(np.float64) - x.astype(np.float64))
  step = want_scales.astype(np.float64)[..., None]
  assert np.all(err <= step * (0.5 + 1e-5)), f"seed {seed}: {np.max(err / step)} steps"
  absmax = np.abs(x).max(-1)
  np.testing.assert_allclose(np.abs(back).max(-1), absmax, rtol=1e-6, err_msg=f"seed {seed}")  # the extreme is exact


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_half_to_even_and_nibbles_pack_low_even(bits):
  levels, s = LEVELS[bits], np.float32(2.0 ** -7)  # scale exactly s: x / s lands on k + 0.5 exactly
  halves = np.arange(-levels, levels, dtype=np.float32) + np.float32(0.5)  # -6.5 .. 6.5 (4 bit)
  row = np.concatenate([[levels], halves, [-levels]]).astype(np.float32)
  row = np.concatenate([row, np.zeros(-len(row) % 2, np.float32)]) * s
  codes, scales = quantize_rows(row[None], bits)
  assert scales[0] == s
  unpacked = np.asarray(quantize.unpack_rows(codes, bits))[0]
  np.testing.assert_array_equal(unpacked[1:1 + len(halves)], np.round(halves))  # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
  assert unpacked[list(halves).index(2.5) + 1] == 2 and unpacked[list(halves).index(-0.5) + 1] == 0
  if bits == 4:  # codes (1, -2): low nibble 0x1 (even index), high nibble 0xE (-2) -> byte 0xE1 = -31
    packed, _ = quantize_rows(np.array([[1.0, -2.0, 7.0, -7.0]], np.float32), 4)
    assert np.asarray(packed).tolist() == [[-31, 0x97 - 256]]  # (7, -7): 0x7 | 0x9 << 4


def test_int4_rejects_odd_rows_and_bits_are_checked():
  with pytest.raises(ValueError, match="d=7 must be even"):
    quantize.quantize_rows(np.ones((2, 7), np.float32), 4)
  with pytest.raises(ValueError, match="8 or 4 bits"):
    quantize.quantize_rows(np.ones((2, 8), np.float32), 2)
  with pytest.raises(ValueError, match="no memory bank"):
    quantize.quantize_model(types.SimpleNamespace(bank=None), 8)  # a vanilla model


# --- the quantized tiny model -------------------------------------------------------------------

BANK = (65, 16, 64)  # tiny: chapters, tokens per chapter, d


def _compiled(model, ids, mask):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, m)[0])
  return fn.lower(state, ids, mask).compile(), state


def _float_bank_arrays(hlo):
  """f32 arrays in compiled HLO shaped like the whole bank: [..., C, T, d] or [..., C*T, d]."""
  c, t, d = BANK
  return sorted(set(re.findall(rf"f32\[(?:[\d,]*,)?(?:{c},{t}|{c * t}),{d}\]", hlo)))


def _nll(logits, ids, mask):
  """Per scored token next-token NLL (float64)."""
  z = np.asarray(logits, np.float64)[:, :-1]
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
  return nll[mask[:, 1:] > 0]


@pytest.fixture(scope="module", params=["sequence", "token"])
def runs(request):
  """Float and int8/int4 logits of one re-drawn tiny model (memory reaching the logits), and the float
  program run on the dequantised banks; one compile per program."""
  seed = SEED
  cfg = moc_jax.load_config("configs/moc.py:tiny", {"model.compute_dtype": "float32", "memory.routing": request.param})
  model = moc_jax.build_model(cfg, seed=seed)
  causality._redraw_zeros(model, seed + 1)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.model.vocab_size, (2, 64)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, 50:] = 0
  run_float, state = _compiled(model, ids, mask)
  out = {"seed": seed, "routing": request.param, "ids": ids, "mask": mask,
         "float": np.asarray(run_float(state, ids, mask)), "hlo_float": run_float.as_text()}
  for bits in (8, 4):
    qmodel = quantize.quantize_model(nnx.clone(model), bits)
    run_q, qstate = _compiled(qmodel, ids, mask)
    out[bits], out[f"hlo{bits}"] = np.asarray(run_q(qstate, ids, mask)), run_q.as_text()
    _, dequantized = nnx.split(nnx.clone(model))
    bank = quantize.dequantize_rows(qmodel.bank.codes[...], qmodel.bank.scales[...], bits)
    dequantized["bank"]["memory"].set_value(bank)
    out[f"float_on_dequantized{bits}"] = np.asarray(run_float(dequantized, ids, mask))
  return out


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_model_equals_float_model_on_the_dequantized_bank(runs, bits):
  np.testing.assert_array_equal(runs[bits], runs[f"float_on_dequantized{bits}"],
                                err_msg=f"{runs['routing']} seed {runs['seed']}")
  assert np.abs(runs[bits] - runs["float"]).max() > 0  # the memory reaches the logits: quantisation shows


def test_sequence_read_holds_codes_not_a_float_bank(runs):
  """Sequence routing dequantises the selected chapters only; per-position routing projects every
  chapter, so its (normalised) float bank exists for that call — the check sees both."""
  assert _float_bank_arrays(runs["hlo_float"]), "the check must find the float bank parameter"
  for bits in (8, 4):
    assert re.search(rf"s8\[1,{BANK[0]},{BANK[1]},{BANK[2] * bits // 8}\]", runs[f"hlo{bits}"])
    found = _float_bank_arrays(runs[f"hlo{bits}"])
    assert (not found) if runs["routing"] == "sequence" else found, found


def test_loss_change_is_small_and_int8_below_int4(runs):
  ids, mask = runs["ids"], runs["mask"]
  ref = _nll(runs["float"], ids, mask)
  delta = {b: _nll(runs[b], ids, mask) - ref for b in (8, 4)}
  ce = {b: float(delta[b].mean()) for b in delta}
  per_token = {b: float(np.abs(delta[b]).mean()) for b in delta}
  print(json.dumps({"routing": runs["routing"], "seed": runs["seed"], "ce_float": float(ref.mean()),
                    "ce_change": ce, "mean_abs_token_change": per_token}))
  assert per_token[8] < per_token[4] / 4 and per_token[4] < 0.01, per_token  # int8 steps are 18x finer


# --- sharded banks (own process, 8 fake devices) ------------------------------------------------

MESHES = {  # memory8: `auto` reads round the ring; the other: scatter, with the codes' rows split by fsdp
    "memory8": {"mesh.data": 1, "mesh.memory": 8},
    "memory2_fsdp2_tensor2_scatter": {"mesh.data": 1, "mesh.memory": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                      "memory.sharded_read": "scatter"},
    "data2_memory4@token": {"mesh.data": 2, "mesh.memory": 4, "memory.routing": "token"},
}
SHARDED_BASE = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 16,
                "memory.top_k": 4, "memory.routing": "sequence"}  # one read per row unless a mesh names another


def _sharded_logits(overrides, params, ids, mask, devices):
  """int4 logits of `params` (user view) on the mesh of `overrides`, and the shape of a codes shard."""
  from moc_jax import sharding
  from moc_jax import state as state_lib
  cfg = moc_jax.load_config("configs/moc.py:tiny", {**SHARDED_BASE, **overrides})
  mesh = sharding.make_mesh(cfg, devices)
  with sharding.activate(mesh, sharding.rules_of(cfg)):
    layout = state_lib.build_state(cfg, mesh)
    params = jax.tree.map(lambda x: x, params)  # a copy: the bank gets this mesh's padded chapters
    extra = layout.padding.padded - layout.padding.real
    params["bank"]["memory"].set_value(np.pad(params["bank"]["memory"][...], ((0, 0), (0, extra), (0, 0), (0, 0))))
    model = nnx.merge(layout.graphdef, jax.device_put(params, layout.shardings["params"]))
    graphdef, state = nnx.split(quantize.quantize_model(model, 4))  # packed codes: fsdp splits half rows
    data = [jax.device_put(x, sharding.data_sharding(cfg, mesh)) for x in (ids, mask)]
    logits = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, m)[0])(state, *data)
    codes = state["bank"]["codes"][...]
    return np.asarray(logits), list(codes.sharding.shard_shape(codes.shape))


def sharded_main(seed):
  cfg = moc_jax.load_config("configs/moc.py:tiny", SHARDED_BASE)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.model.vocab_size, (16, 32)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[::3, -5:] = 0
  refs = {}
  for name, overrides in MESHES.items():
    routing = overrides.get("memory.routing", "sequence")
    if routing not in refs:
      cfg = moc_jax.load_config("configs/moc.py:tiny", {**SHARDED_BASE, "memory.routing": routing})
      model = moc_jax.build_model(cfg, seed=seed)
      causality._redraw_zeros(model, seed + 1)
      params = nnx.state(model, nnx.Param)
      one = {"mesh.data": 1, "num_fake_devices": 1, "memory.routing": routing}
      refs[routing] = params, _sharded_logits(one, params, ids, mask, jax.devices()[:1])[0]
    params, ref = refs[routing]
    logits, shard = _sharded_logits(overrides, params, ids, mask, jax.devices())
    print(json.dumps({"mesh": name, "codes_shard": shard, "max_diff": float(np.abs(logits - ref).max())}), flush=True)
  # int4 rows of d = 24 are 12 bytes: an 8-way split of the bank's rows cannot hold them
  rows_split = jax.sharding.NamedSharding(jax.make_mesh((8,), ("fsdp",)), jax.P(None, None, None, "fsdp"))
  bank = jax.device_put(np.ones((1, 8, 4, 24), np.float32), rows_split)
  try:
    quantize.QuantizedChapterBank(nnx.Param(bank), 4)
  except ValueError as e:
    print(json.dumps({"indivisible_int4": str(e)}))


def test_sharded_reads_of_a_quantized_bank_equal_one_device():
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  seed = SEED
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "sharded", str(seed)], capture_output=True,
                        text=True, timeout=900, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  rows = {r["mesh"]: r for r in lines if "mesh" in r}
  assert set(rows) == set(MESHES)
  assert "does not divide" in lines[-1]["indivisible_int4"]
  for r in rows.values():
    assert r["max_diff"] <= 1e-5, (seed, r)
  assert rows["memory8"]["codes_shard"] == [1, 9, 16, 32]  # 72 padded chapters over 8 devices, int4: d/2
  assert rows["memory2_fsdp2_tensor2_scatter"]["codes_shard"] == [1, 33, 16, 16]


if __name__ == "__main__":
  if sys.argv[1] == "sharded":
    sharded_main(int(sys.argv[2]))
