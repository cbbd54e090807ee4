"""Reading selected chapters (moc_jax.model.chapter_read) against references that share no code with it.

* `read_chapters` is a gather: on one device and on chapter-sharded banks (2 and 4 devices, `ring` and
  `scatter`) it must equal numpy's `bank[ids]` bit for bit, for float banks and for quantized ones
  (`QuantizedRows`: numpy's dequantisation of the gathered codes), with chapter counts padded to the
  shard count (zero chapters no id names) and chapter ids repeated within a row. Its gradient must be
  numpy's scatter-add of the cotangent (integer-valued, so every sum is exact).
* `routed_attention` on a sharded bank (expert parallelism over chapters) must equal the same call on one
  device, and both a float64 numpy restatement of the attention.

The sharded cases run in one process of 4 fake CPU devices (the suite's processes keep one):
`python tests/model/test_chapter_read.py` runs them all and prints one JSON line of their outputs; the
references are computed here, in the test process.
"""
import base64
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax.model.chapter_read import read_chapters, routed_attention
from moc_jax.model.quantize import QuantizedRows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 4
T, D = 3, 8                # tokens per chapter, row width of the bank
B, S = 8, 3                # rows of chapter ids (divisible by every mesh's batch split), slots per row
L, H, HKV, DH = 2, 4, 2, 8  # routed attention: positions, query heads, kv heads (grouped), head width
LAYOUTS = {  # mesh axis sizes (a 2-device mesh takes the first two devices) and the chapters routers see
    "memory2": ({"memory": 2}, 5),                  # padded to 6
    "memory4": ({"memory": 4}, 5),                  # padded to 8: the last shard holds padding only
    "memory4_unpadded": ({"memory": 4}, 8),
    "memory2_fsdp2": ({"memory": 2, "fsdp": 2}, 6),  # each chapter's rows split by fsdp, re-joined to read
    "data2_memory2": ({"data": 2, "memory": 2}, 7),  # padded to 8; two groups of two devices share a bank
}
ATTENTION_LAYOUTS = ("memory2", "memory4", "data2_memory2")  # padded; a shard of padding only; data x memory
MODES = ("ring", "scatter")
KINDS = ("float32", "int8", "int4")
COMBINES = ("joint", "moe")
MIN_SCALE = np.float32(1e-8)  # the scale of an all-zero (padded) row once quantized


# --- inputs (numpy, fixed seeds; the worker and the tests draw the same) -----------------------------

def padded(real, shards):
  """Chapters stored on `shards` devices: `real` rounded up to a multiple of the shard count."""
  return -(-real // shards) * shards


def layout_chapters(name):
  """(real, padded) chapter counts of a layout."""
  sizes, real = LAYOUTS[name]
  return real, padded(real, sizes["memory"])


def chapter_ids(rng, real, shape):
  """Ids in [0, real) with a row reading the last real chapter (beside the padding) in every slot and
  rows that repeat an id; never a padded chapter."""
  ids = rng.integers(0, real, shape).astype(np.int32)
  ids[0] = real - 1
  ids[1, 1:] = ids[1, :1]
  ids[2, ::2] = 0
  return ids


def zero_padding(x, real):
  x[real:] = 0
  return x


def read_inputs(name):
  """ids [B, S], a float bank [C, T, D], int8 and int4 banks {bits: (codes, scales)}, and an integer-valued
  cotangent [B, S, T, D] for the gradient; chapters past `real` are padding (zeros; as quantize_rows
  stores an all-zero row: codes 0, scale 1e-8)."""
  real, c = layout_chapters(name)
  rng = np.random.default_rng(list(LAYOUTS).index(name))
  ids = chapter_ids(rng, real, (B, S))
  bank = zero_padding(rng.normal(size=(c, T, D)).astype(np.float32), real)
  quantized = {}
  for bits in (8, 4):  # any byte is a valid code: int8 one value, int4 two sign-extended nibbles
    codes = zero_padding(rng.integers(-128, 128, (c, T, D * bits // 8)).astype(np.int8), real)
    scales = rng.uniform(1e-3, 1.0, (c, T)).astype(np.float32)
    scales[real:] = MIN_SCALE
    quantized[bits] = codes, scales
  cotangent = rng.integers(-4, 5, (B, S, T, D)).astype(np.float32)
  return ids, bank, quantized, cotangent


def bank_of(kind, bank, quantized):
  """The bank `read_chapters` takes for `kind` (float32 | int8 | int4)."""
  if kind == "float32":
    return bank
  bits = int(kind[3:])
  return QuantizedRows(*quantized[bits], bits)


def attention_inputs(name):
  """q [B, L, H, DH], k and v [C, T, HKV, DH] (padded chapters zero), ids [B, L, S] in [-1, real) and
  the two per-slot scales. Token (0, 0) has no chapter, token (0, 1) one chapter in every slot; other
  slots are empty at random."""
  real, c = layout_chapters(name)
  rng = np.random.default_rng(100 + list(LAYOUTS).index(name))
  q = rng.normal(size=(B, L, H, DH)).astype(np.float32)
  k, v = (zero_padding(rng.normal(size=(c, T, HKV, DH)).astype(np.float32), real) for _ in range(2))
  ids = chapter_ids(rng, real, (B, L, S))
  ids[rng.random(ids.shape) < 0.2] = -1
  ids[0, 0] = -1
  ids[0, 1] = real - 1
  logit_scale = rng.uniform(0.5, 2.0, ids.shape).astype(np.float32)
  value_scale = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
  return q, k, v, ids, logit_scale, value_scale


# --- references -----------------------------------------------------------------------------------

def np_dequantize(codes, scales, bits):
  """float32 rows: int8 codes, or int4 nibbles (low = even index) sign-extended, times the row's scale."""
  if bits == 4:
    u = codes.view(np.uint8)
    nibbles = np.stack([u & 0x0F, u >> 4], -1).reshape(codes.shape[:-1] + (-1,)).astype(np.int16)
    codes = np.where(nibbles > 7, nibbles - 16, nibbles)
  return codes.astype(np.float32) * scales[..., None]


def np_read(kind, ids, bank, quantized):
  """bank[ids] by numpy indexing (quantized: the gathered codes and scales, dequantised)."""
  if kind == "float32":
    return bank[ids]
  bits = int(kind[3:])
  codes, scales = quantized[bits]
  return np_dequantize(codes[ids], scales[ids], bits)


def np_read_grad(ids, bank, cotangent):
  """d/d bank of sum(bank[ids] * cotangent): the cotangent scatter-added to the chapters read."""
  grad = np.zeros_like(bank)
  np.add.at(grad, ids, cotangent)
  return grad


def np_softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def np_attention(q, k, v, ids, logit_scale, value_scale, combine):
  """The contract in float64, one (token, head) at a time: slot s contributes logits
  logit_scale_s q.k_t / sqrt(dh) over its chapter's T keys and values value_scale_s v_t; joint: one
  softmax over every slot's keys; moe: a softmax per slot, outputs summed. No slot: zeros."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape)
  for b, pos, h in np.ndindex(*q.shape[:3]):
    slots = [s for s in range(ids.shape[2]) if ids[b, pos, s] >= 0]
    if not slots:
      continue
    logits = [logit_scale[b, pos, s] * (k[ids[b, pos, s], :, h // group] @ q[b, pos, h]) / np.sqrt(q.shape[3])
              for s in slots]
    values = [value_scale[b, pos, s] * v[ids[b, pos, s], :, h // group] for s in slots]
    if combine == "joint":
      out[b, pos, h] = np_softmax(np.concatenate(logits)) @ np.concatenate(values)
    else:
      out[b, pos, h] = sum(np_softmax(z) @ x for z, x in zip(logits, values))
  return out


def assert_bits_equal(got, want, what):
  """Same dtype, shape and bit pattern (float32 compared as uint32: a gather moves bits, rounds nothing)."""
  assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=what)


def attend(inputs, combine):
  """routed_attention compiled as one program (on the active mesh, if any)."""
  return np.asarray(jax.jit(functools.partial(routed_attention, combine=combine))(*inputs))


# Attention outputs are float32 sums of a few (<= S*T) O(1) terms: against float64, and sharded against one
# device (the same terms merged per shard by psum / log-sum-exp, in another order), they may differ by a
# few roundings. Allowed: ULPS float32 epsilons of the largest output (observed: at most 3).
ULPS = 8


def assert_attention_close(got, want, what):
  scale = float(np.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=ULPS * np.finfo(np.float32).eps * scale, err_msg=what)


# --- one device (this process: no mesh, a plain gather) ----------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_read_without_a_mesh_is_a_numpy_gather(kind):
  """Without an active mesh the read is `take` (+ dequantise): numpy's gather, bit for bit, on a padded
  bank with repeated ids."""
  ids, bank, quantized, _ = read_inputs("memory4")
  got = jax.jit(read_chapters)(bank_of(kind, bank, quantized), ids)
  assert_bits_equal(np.asarray(got), np_read(kind, ids, bank, quantized), kind)


@pytest.mark.parametrize("combine", COMBINES)
def test_routed_attention_without_a_mesh_matches_float64_numpy(combine):
  """One call of routed_chapter_attention (GQA, empty slots, a token without chapters, repeated
  chapters in a token) against the contract restated in float64."""
  inputs = attention_inputs("memory2")
  got = attend(inputs, combine)
  want = np_attention(*inputs, combine)
  assert_attention_close(got, want, combine)
  assert not got[0, 0].any() and np.abs(got[0, 1]).max() > 0.1


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("chunk", [1, 2, L - 1])
def test_reading_in_chunks_of_positions_matches_float64_numpy_and_its_gradients(combine, chunk):
  """memory.read_chunk: the positions read `chunk` at a time (a remat scan, the last slice padded with empty slots)
  give the contract's outputs, and the same gradients in q, k, v and the scales as one call."""
  inputs = attention_inputs("memory2")
  read = functools.partial(routed_attention, combine=combine)
  got = np.asarray(jax.jit(functools.partial(read, chunk=chunk))(*inputs))
  assert_attention_close(got, np_attention(*inputs, combine), combine)
  cot = np.random.default_rng(7).normal(size=got.shape).astype(np.float32)
  argnums = (0, 1, 2, 4, 5)
  grads = [jax.jit(jax.grad(lambda *x, c=c: jnp.vdot(read(*x, chunk=c), cot), argnums=argnums))(*inputs)
           for c in (0, chunk)]
  for whole, chunked in zip(*grads):
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6 * float(np.abs(whole).max()))


# --- sharded banks (one process, 4 fake devices) ------------------------------------------------------

def encode(x):
  x = np.asarray(x)
  return {"dtype": x.dtype.str, "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def decode(d):
  return np.frombuffer(base64.b64decode(d["data"]), np.dtype(d["dtype"])).reshape(d["shape"])


def make_mesh(sizes, rules=None):
  """The tiny config's mesh of `sizes` over the first devices, and its logical axis rules (or `rules`)."""
  overrides = {f"mesh.{axis}": sizes.get(axis, 1) for axis in sharding.MESH_AXES}
  count = int(np.prod(list(sizes.values())))
  config = moc_jax.load_config("configs/moc.py:tiny", {**overrides, "num_fake_devices": count})
  return sharding.make_mesh(config, jax.devices()[:count]), rules or sharding.rules_of(config)


def place(mesh, x, *logical):
  """x on `mesh`, split by logical axis names under the active rules."""
  return jax.device_put(x, jax.sharding.NamedSharding(mesh, sharding.logical_spec(mesh, *logical)))


def placed_bank(mesh, kind, bank, quantized):
  """The bank of `kind` sharded as the model holds it (scales: the codes' spec without the row axis)."""
  bank = bank_of(kind, bank, quantized)
  if isinstance(bank, QuantizedRows):
    return QuantizedRows(place(mesh, bank.codes, "chapters", "chapter_tokens", "bank_embed"),
                         place(mesh, bank.scales, "chapters", "chapter_tokens"), bank.bits)
  return place(mesh, bank, "chapters", "chapter_tokens", "bank_embed")


def sharded_layout(name):
  """Every output of layout `name`: reads per (mode, kind), bank gradients per mode, attention per
  combine (ATTENTION_LAYOUTS), and the shape of a device's bank shard."""
  ids, bank, quantized, cotangent = read_inputs(name)
  mesh, rules = make_mesh(LAYOUTS[name][0])
  out = {}
  with sharding.activate(mesh, rules):
    ids = place(mesh, ids, "batch", None)
    read = jax.jit(read_chapters, static_argnums=2)
    grad = jax.jit(jax.grad(lambda b, i, g, mode: jnp.sum(read_chapters(b, i, mode) * g)), static_argnums=3)
    for mode in MODES:
      for kind in KINDS:
        out[f"read/{mode}/{kind}"] = read(placed_bank(mesh, kind, bank, quantized), ids, mode)
      out[f"grad/{mode}"] = grad(placed_bank(mesh, "float32", bank, quantized), ids,
                                 place(mesh, cotangent, "batch", None, None, None), mode)
    if name in ATTENTION_LAYOUTS:
      q, k, v, *slots = attention_inputs(name)
      q = place(mesh, q, "batch", None, "heads", None)
      k, v = (place(mesh, x, "chapters", "chapter_tokens", "kv", None) for x in (k, v))
      slots = [place(mesh, x, "batch", None, None) for x in slots]
      for combine in COMBINES:
        out[f"attention/{combine}"] = attend((q, k, v, *slots), combine)
    shard = placed_bank(mesh, "float32", bank, quantized)
  encoded = {key: encode(x) for key, x in out.items()}
  encoded["shard"] = encode(np.array(shard.sharding.shard_shape(shard.shape)))
  return encoded


def rejections():
  """The messages of a read and an attention on a bank whose chapter axis does not split `batch`."""
  rules = (("batch", "data"), ("chapters", "memory"))
  mesh, rules = make_mesh({"memory": 2}, rules)
  ids, bank, _, _ = read_inputs("memory2")
  q, k, v, *slots = attention_inputs("memory2")
  calls = {"read": lambda: read_chapters(bank, ids, "ring"),
           "attention": lambda: routed_attention(q, k, v, *slots, combine="joint")}
  messages = {}
  with sharding.activate(mesh, rules):
    for name, call in calls.items():
      try:
        call()
        messages[name] = None
      except ValueError as e:
        messages[name] = str(e)
  return messages


def sharded_main():
  print(json.dumps({"devices": jax.device_count(), "layouts": {name: sharded_layout(name) for name in LAYOUTS},
                    "rejected": rejections()}), flush=True)


@pytest.fixture(scope="module")
def sharded():
  """The worker's outputs: {"layouts": {layout: {key: array}}, "rejected": {call: message}}."""
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES)}
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, check=False,
                        timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
  assert line["devices"] == DEVICES
  line["layouts"] = {name: {key: decode(x) for key, x in arrays.items()} for name, arrays in line["layouts"].items()}
  return line


def test_banks_are_sharded_over_their_chapters(sharded):
  """Each device holds its block of the padded chapters (and half the rows under fsdp): the reads below
  ran on sharded banks, not on a replicated copy."""
  for name, (sizes, _) in LAYOUTS.items():
    _, c = layout_chapters(name)
    want = [c // sizes["memory"], T, D // sizes.get("fsdp", 1)]
    assert sharded["layouts"][name]["shard"].tolist() == want, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_sharded_read_is_a_numpy_gather(sharded, name, mode, kind):
  """`ring` and `scatter` on a chapter-sharded bank: numpy's gather bit for bit (padded chapters,
  repeated ids, quantized banks dequantised after the read)."""
  ids, bank, quantized, _ = read_inputs(name)
  got = sharded["layouts"][name][f"read/{mode}/{kind}"]
  assert_bits_equal(got, np_read(kind, ids, bank, quantized), f"{name} {mode} {kind}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_sharded_read_gradient_is_a_numpy_scatter_add(sharded, name, mode):
  """The bank's gradient (ring: its own backward ring; scatter: autodiff of the reduce-scatter) is the
  cotangent scatter-added to the chapters read — zero on padding; integer values make it exact."""
  ids, bank, _, cotangent = read_inputs(name)
  assert_bits_equal(sharded["layouts"][name][f"grad/{mode}"], np_read_grad(ids, bank, cotangent), f"{name} {mode}")


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("name", ATTENTION_LAYOUTS)
def test_sharded_routed_attention_equals_one_device_and_float64_numpy(sharded, name, combine):
  """Expert parallelism over chapters (queries all-gathered, partial results summed or merged by
  log-sum-exp) against the same call without a mesh, and against float64 numpy."""
  inputs = attention_inputs(name)
  got = sharded["layouts"][name][f"attention/{combine}"]
  one = attend(inputs, combine)
  assert_attention_close(got, one, f"{name} {combine}: one device")
  assert_attention_close(got, np_attention(*inputs, combine), f"{name} {combine}: float64")
  assert not got[0, 0].any()  # a token without chapters reads nothing on every shard


def test_chapter_axis_that_does_not_split_batch_is_rejected(sharded):
  """Each device must hold its own slice of the batch along the chapter axis: rules that shard chapters
  over `memory` but not the batch are refused by both reads."""
  assert set(sharded["rejected"]) == {"read", "attention"}
  for name, message in sharded["rejected"].items():
    assert message and "must also split `batch`" in message, (name, message)


if __name__ == "__main__":
  sharded_main()
