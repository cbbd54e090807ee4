"""The product-key value table (moc_jax.model.value_table) read on one device and with its slots sharded over 2
and 4 fake devices, against numpy.

* `read_rows` is sum_s w_s * table[ids_s]: with integer-valued tables and weights every sum is exact, so on one
  device and on every sharded layout (slots split over `memory`, padded to the shard count or not; a data x
  memory mesh; each row's width split over fsdp and re-joined) it must equal numpy bit for bit, and so must its
  gradients in the table (the weighted cotangent scatter-added into the rows read; zero on padded and unread
  rows) and in the weights.
* Each device holds its block of the padded slots: the reads ran on a sharded table.
* A whole pkm, hml and ffn model (loss and every gradient) and a lazy AdamW train step on memory-sharded meshes
  equal one device's (@slow; ffn's columns are read by model/ffn_memory.py's sharded read, the same scheme).

The sharded cases run in a process of 4 fake CPU devices (the suite's processes keep one):
`python tests/model/test_value_table.py [model]` prints one JSON line; the references are computed here.
"""
import base64
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
from moc_jax.model.value_table import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 4
B, L, S, D = 8, 3, 5, 6  # rows (divisible by every mesh's batch split), positions, slots read per position, width
LAYOUTS = {  # mesh axis sizes, the slots products keys name, extra rules
    "memory2": ({"memory": 2}, 9, ()),                    # padded to 10
    "memory4": ({"memory": 4}, 9, ()),                    # padded to 12: the last shard holds 1 real slot
    "memory4_unpadded": ({"memory": 4}, 16, ()),
    "data2_memory2": ({"data": 2, "memory": 2}, 9, ()),   # two groups of two devices share a table
    "memory2_fsdp2": ({"memory": 2, "fsdp": 2}, 9, (("value_embed", "fsdp"),)),  # a row's width split, re-joined
}


def padded(real, shards):
  return -(-real // shards) * shards


def inputs(name):
  """ids [B, L, S] in [0, real) (a row reading the last real slot everywhere, repeats within a position),
  weights, a table [padded, D] (padding zero) and a cotangent [B, L, D]: all small integers, so every sum of
  products is exact in float32."""
  sizes, real, _ = LAYOUTS[name]
  rng = np.random.default_rng(list(LAYOUTS).index(name))
  ids = rng.integers(0, real, (B, L, S)).astype(np.int32)
  ids[0] = real - 1
  ids[1, :, 1:] = ids[1, :, :1]
  weights = rng.integers(-3, 4, (B, L, S)).astype(np.float32)
  table = rng.integers(-4, 5, (padded(real, sizes["memory"]), D)).astype(np.float32)
  table[real:] = 0
  cotangent = rng.integers(-2, 3, (B, L, D)).astype(np.float32)
  return ids, weights, table, cotangent


def np_read(ids, weights, table):
  return np.einsum("bls,blsd->bld", weights.astype(np.float64), table.astype(np.float64)[ids])


def np_grads(ids, weights, table, cotangent):
  """(d/d table, d/d weights) of sum(read * cotangent)."""
  g_table = np.zeros(table.shape)
  np.add.at(g_table, ids.reshape(-1), (weights[..., None] * cotangent[:, :, None, :]).reshape(-1, D))
  return g_table, np.einsum("bld,blsd->bls", cotangent.astype(np.float64), table.astype(np.float64)[ids])


def read_and_grads(table, ids, weights, cotangent):
  def f(table, weights):
    return jnp.sum(read_rows(table, ids, weights) * cotangent)
  return jax.jit(lambda t, w: (read_rows(t, ids, w), *jax.grad(f, argnums=(0, 1))(t, w)))(table, weights)


def test_one_device_read_and_gradients_equal_numpy():
  ids, weights, table, cotangent = inputs("memory4")
  out, g_table, g_weights = read_and_grads(*map(jnp.asarray, (table, ids, weights, cotangent)))
  want_table, want_weights = np_grads(ids, weights, table, cotangent)
  np.testing.assert_array_equal(np.asarray(out), np_read(ids, weights, table))
  np.testing.assert_array_equal(np.asarray(g_table), want_table)
  np.testing.assert_array_equal(np.asarray(g_weights), want_weights)
  assert not np.asarray(g_table)[np.setdiff1d(np.arange(len(table)), ids)].any()


# --- the worker (4 fake devices) ----------------------------------------------------------------------

def encode(x):
  x = np.asarray(x)
  return {"dtype": x.dtype.str, "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def decode(d):
  return np.frombuffer(base64.b64decode(d["data"]), np.dtype(d["dtype"])).reshape(d["shape"])


def layout_outputs(name):
  sizes, _, extra_rules = LAYOUTS[name]
  overrides = {f"mesh.{axis}": sizes.get(axis, 1) for axis in sharding.MESH_AXES}
  count = int(np.prod(list(sizes.values())))
  config = moc_jax.load_config("configs/moc.py:tiny", {**overrides, "num_fake_devices": count})
  mesh = sharding.make_mesh(config, jax.devices()[:count])
  rules = tuple(r for r in sharding.rules_of(config) if r[0] not in dict(extra_rules)) + extra_rules
  ids, weights, table, cotangent = inputs(name)
  with sharding.activate(mesh, rules):
    def place(x, *logical):
      return jax.device_put(x, jax.sharding.NamedSharding(mesh, sharding.logical_spec(mesh, *logical)))
    table = place(table, "slots", "value_embed")
    out = read_and_grads(table, place(ids, "batch", None, None), place(weights, "batch", None, None),
                         place(cotangent, "batch", None, None))
  return {"read": encode(out[0]), "grad_table": encode(out[1]), "grad_weights": encode(out[2]),
          "shard": encode(np.array(table.sharding.shard_shape(table.shape)))}


MODEL_MESHES = {"memory2": {"mesh.data": 1, "mesh.memory": 2}, "memory4": {"mesh.data": 1, "mesh.memory": 4},
                "data2_memory2": {"mesh.data": 2, "mesh.memory": 2}}
MODEL_BASE = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 8,
              "memory.pkm_sub_keys": 5, "memory.pkm_top_k": 4, "memory.pkm_key_dim": 16, "memory.wo_init_zero": False,
              "train.bank_optimizer": "lazy_adam", "train.warmup_steps": 0, "train.schedule": "constant"}


# ffn: 1 shared + 2·4 + 1·16 = 25 columns fetched by two-level cluster paths (k = 4), as the value tables' 25 slots
KIND_BASE = {"ffn": {"memory.routing": "cluster", "data.cluster.k": 4, "data.cluster.levels": 2,
                     "memory.cluster_chapters": (2, 1), "memory.num_chapters": 25}}


def model_outputs(kind, mesh_name):
  """Loss, gradients and the parameters after one lazy AdamW step of the tiny `kind` model on a mesh (None:
  one device), as the user view (padded slots dropped)."""
  from flax import nnx
  from moc_jax import state as state_lib
  from moc_jax.losses import lm_loss
  from moc_jax.train.step import jit_train_step
  mesh_overrides = MODEL_MESHES[mesh_name] if mesh_name else {"mesh.data": 1}
  count = int(np.prod([v for k, v in mesh_overrides.items()]))
  config = moc_jax.load_config("configs/moc.py:tiny", {**MODEL_BASE, "memory.kind": kind, **KIND_BASE.get(kind, {}),
                                                      **mesh_overrides, "num_fake_devices": count})
  mesh = sharding.make_mesh(config, jax.devices()[:count])
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 260, (8, 32)).astype(np.int32)
  batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}
  if kind == "ffn":  # each row one document, on its own path
    batch["cluster_path"] = np.broadcast_to(rng.integers(0, 4, (8, 1, 2)) * [1, 4] + [0, 1], (8, 32, 2)).astype(
        np.int32)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    if kind in ("hml", "ffn"):  # non-zero values (an hml table, ffn's down vectors start at zero): the read shows
      table = state["params"]["bank"]["memory"]
      state["params"]["bank"]["memory"] = table.replace(
          jax.device_put(jax.random.normal(jax.random.key(1), table.shape), table.sharding))
    data = jax.device_put(batch, sharding.data_sharding(config, mesh))
    loss, grads = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(nnx.merge(layout.graphdef, p), b, train=True)[0]))(
        state["params"], data)
    step = jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, sharding.data_sharding(config, mesh))
    new, _ = step(state, data)
    user = sharding.unpad_tree({"grads": grads, "params": new["params"]}, layout.padding)
  flat = {"/".join(map(str, k)): encode(v) for k, v in nnx.to_flat_state(user["grads"])}
  table = user["params"]["bank"]["memory"][...]
  return {"loss": float(loss), "grads": flat, "table_after_step": encode(table),
          "table_shard": list(layout.shardings["params"]["bank"]["memory"].shard_shape(
              layout.abstract["params"]["bank"]["memory"].shape))}


def main(argv):
  if argv[1:] == ["model"]:
    out = {kind: {name: model_outputs(kind, name) for name in (None, *MODEL_MESHES)} for kind in ("pkm", "hml", "ffn")}
    print(json.dumps({"devices": jax.device_count(), "models": out}), flush=True)
    return
  print(json.dumps({"devices": jax.device_count(), "layouts": {n: layout_outputs(n) for n in LAYOUTS}}), flush=True)


def run_worker(*args):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES)}
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                        check=False, timeout=900, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
  assert line["devices"] == DEVICES
  return line


@pytest.fixture(scope="module")
def sharded():
  line = run_worker()
  return {name: {k: decode(v) for k, v in out.items()} for name, out in line["layouts"].items()}


def test_tables_are_sharded_over_their_slots(sharded):
  for name, (sizes, real, _) in LAYOUTS.items():
    want = [padded(real, sizes["memory"]) // sizes["memory"], D // sizes.get("fsdp", 1)]
    assert sharded[name]["shard"].tolist() == want, name


@pytest.mark.parametrize("name", LAYOUTS)
def test_sharded_read_and_gradients_equal_numpy(sharded, name):
  ids, weights, table, cotangent = inputs(name)
  want_table, want_weights = np_grads(ids, weights, table, cotangent)
  got = sharded[name]
  np.testing.assert_array_equal(got["read"], np_read(ids, weights, table), err_msg=name)
  np.testing.assert_array_equal(got["grad_table"], want_table, err_msg=name)
  np.testing.assert_array_equal(got["grad_weights"], want_weights, err_msg=name)
  assert not got["grad_table"][LAYOUTS[name][1]:].any()  # padded slots: never read, never moved


@pytest.mark.slow
def test_sharded_models_and_lazy_steps_equal_one_device():
  """pkm, hml and ffn (tiny, 25 slots or columns: padded to 26 and 28) on memory x 2, memory x 4 and data x memory meshes: the
  loss, every gradient and the table after one lazy AdamW step (the masked update of a sharded table against
  one device's row update) equal one device's."""
  models = run_worker("model")["models"]
  for kind, runs in models.items():
    ref = runs["null"]
    for name in MODEL_MESHES:
      got = runs[name]
      assert got["table_shard"][1] == -(-25 // MODEL_MESHES[name]["mesh.memory"]), (kind, name)
      np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6, err_msg=f"{kind} {name}")
      for path, g in got["grads"].items():
        want = decode(ref["grads"][path])
        np.testing.assert_allclose(decode(g), want, rtol=1e-4, atol=1e-6 * max(1.0, np.abs(want).max()),
                                   err_msg=f"{kind} {name} {path}")
      # Adam divides by sqrt(v): near-zero gradients that round differently move a row by up to the LR
      after, want = decode(got["table_after_step"]), decode(ref["table_after_step"])
      assert np.abs(after - want).max() <= 5e-5, (kind, name)


if __name__ == "__main__":
  main(sys.argv)
