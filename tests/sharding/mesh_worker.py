"""Runs in its own process with 8 fake CPU devices (the test suite's processes keep one device).

`python tests/sharding/mesh_worker.py equivalence [MESH[@ROUTING] ...]` — loss and gradients of the tiny MoC
model (float32) on several meshes against one device (same `memory.routing`); one JSON line per mesh.
`python tests/sharding/mesh_worker.py restore DIR` — trains 2 steps on a data x memory mesh, saves, and
restores the checkpoint onto other meshes and onto one device; prints the largest difference.
"""
import json
import os
import sys

# 8 fake devices; compile time dominates these checks, so XLA's backend optimisation is turned down
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import moc_jax  # noqa: E402
from moc_jax import sharding  # noqa: E402
from moc_jax.losses import lm_loss  # noqa: E402
from moc_jax import state as state_lib  # noqa: E402
from moc_jax.train.step import jit_train_step  # noqa: E402

MESHES = {  # name -> (config.mesh overrides, extra rule overrides)
    "one_device": {},
    "data8": {"mesh.data": 8},
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    "memory8": {"mesh.data": 1, "mesh.memory": 8},
    "data2_memory4": {"mesh.data": 2, "mesh.memory": 4},
    "memory2_fsdp2_tensor2": {"mesh.data": 1, "mesh.memory": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    "data4_tensor2": {"mesh.data": 4, "mesh.tensor": 2},
    # `auto` reads memory8 round the ring and data2_memory4 by scatter; the other strategy of each:
    "memory8_scatter": {"mesh.data": 1, "mesh.memory": 8, "memory.sharded_read": "scatter"},
    "data2_memory4_ring": {"mesh.data": 2, "mesh.memory": 4, "memory.sharded_read": "ring"},
}
# `sequence` routing (one read per row: the ring and scatter strategies) unless a mesh names another
BASE = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 16,
        "memory.top_k": 4, "memory.routing": "sequence"}


def config_for(name, extra=None):
  name, _, routing = name.partition("@")
  mesh = dict(MESHES[name], **({"memory.routing": routing} if routing else {}))
  if name == "one_device":  # the reference runs on devices[:1]; validate() checks the mesh against that count
    mesh = {"mesh.data": 1, "num_fake_devices": 1, **{k: v for k, v in mesh.items() if k.startswith("memory.")}}
  return moc_jax.load_config("configs/moc.py:tiny", {**BASE, **mesh, **(extra or {})})


def devices_for(name):
  return jax.devices()[:1] if name.partition("@")[0] == "one_device" else jax.devices()


def batch(config, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, config.model.vocab_size, (config.train.batch_size, config.data.seq_len), np.int32)
  mask = np.ones_like(ids)
  mask[::3, -5:] = 0  # some right padding
  return {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask > 0, ids, -100)}


def loss_and_grads(name):
  config = config_for(name)
  mesh = sharding.make_mesh(config, devices_for(name))
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    params = layout.init()["params"]
    data = jax.device_put(batch(config), sharding.data_sharding(config, mesh))

    def f(p, b):
      return lm_loss(nnx.merge(layout.graphdef, p), b, train=True)[0]

    loss, grads = jax.jit(jax.value_and_grad(f))(params, data)
    bank_shard = layout.shardings["params"]["bank"]["memory"].shard_shape(layout.abstract["params"]["bank"]["memory"].shape)
    # the user view: padded chapters dropped, as checkpoints hold them
    grads = sharding.unpad_tree(grads, layout.padding)
    params = sharding.unpad_tree(params, layout.padding)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    pflat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(params)}
    return float(loss), flat, pflat, list(bank_shard), layout.padding.padded


def equivalence(names):
  import time
  t0 = time.time()
  refs = {}
  for name in names:
    routing = name.partition("@")[2]
    if routing not in refs:
      refs[routing] = loss_and_grads("one_device" + ("@" + routing if routing else ""))
    ref_loss, ref_grads, ref_params, _, _ = refs[routing]
    loss, grads, params, shard, padded = loss_and_grads(name)
    grad_err = {k: float(np.max(np.abs(grads[k] - ref_grads[k])) / (np.max(np.abs(ref_grads[k])) + 1e-30))
                for k in ref_grads}
    worst = max(grad_err, key=grad_err.get)
    print(json.dumps({"mesh": name, "loss": loss, "ref_loss": ref_loss, "worst_grad": worst,
                      "worst_grad_rel_err": grad_err[worst],
                      "params_equal": all(np.array_equal(params[k], ref_params[k]) for k in ref_params),
                      "bank_shard": shard, "padded_chapters": padded, "t": round(time.time() - t0, 1)}), flush=True)


def restore(workdir):
  """Full state saved through the run's Checkpointer on data2_memory4, restored onto other meshes."""
  from moc_jax import checkpoint as ckpt_lib
  config = config_for("data2_memory4")
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    step = jit_train_step(layout.graphdef, layout.tx, config, layout.shardings,
                               sharding.data_sharding(config, mesh))
    for s in range(2):
      state, _ = step(state, jax.device_put(batch(config, s), sharding.data_sharding(config, mesh)))
    saved = jax.tree.map(np.asarray, sharding.unpad_tree({k: state[k] for k in ("params", "opt_state")},
                                                         layout.padding))
    ck = ckpt_lib.Checkpointer(workdir, padding=layout.padding)
    ck.save(2, state)
    ck.close()
  for name in ("memory8", "fsdp8", "memory2_fsdp2_tensor2", "one_device"):
    cfg = config_for(name)
    m = sharding.make_mesh(cfg, devices_for(name))
    with sharding.activate(m, sharding.rules_of(cfg)):
      lay = state_lib.build_state(cfg, m)
      ck = ckpt_lib.Checkpointer(workdir, padding=lay.padding)
      got = ck.restore(2, lay.abstract)
      ck.close()
      bank = got["params"]["bank"]["memory"]
      back = sharding.unpad_tree({k: got[k] for k in ("params", "opt_state")}, lay.padding)
      diff = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in
                 zip(jax.tree.leaves(back), jax.tree.leaves(saved)))
      print(json.dumps({"mesh": name, "max_abs_diff": diff, "padded": lay.padding.padded, "step": int(got["step"]),
                        "pad_is_zero": bool(np.all(np.asarray(bank[:, cfg.memory.num_chapters:]) == 0)),
                        "shard": list(bank.sharding.shard_shape(bank.shape))}), flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "equivalence":
    equivalence(sys.argv[2:] or [m for m in MESHES if m != "one_device"])
  else:
    restore(sys.argv[2])
