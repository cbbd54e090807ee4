"""Depth up-scaling (`train.upscale_from`, moc_jax/upscale.py): a trained run's model with memory inserted.

The base runs are `tiny` models whose every parameter is drawn away from its initialisation (norm scales too, so a
copied norm shows), saved as training saves weights. Float32 throughout, fixed seeds.

* At step 0 the up-scaled model's logits are the base model's own forward on its own parameters (1e-5): hml
  blocks inserted at explicit layers and spread over depth (`memory.placement=spread`), copying the attention of the
  block after them (MIDUS) or before them (Llama Pro), scanned and unrolled layouts on both sides; chapter and pkm
  reads inserted inside layers; and a MoC base whose memory layers and bank are kept while chapter layers are added.
* Each inserted hml block's norm and q, k, v are those of the block it copies, bit for bit.
* With train.freeze_base, three train steps leave every base parameter as the base run saved it, bit for bit, and
  move every inserted one.
* A bad field: one ConfigError naming it, from the config alone or against the base run; from the command line one
  `error:` line, exit 2, the base run untouched.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import sharding, upscale
from moc_jax import state as state_lib
from moc_jax.checkpoint import write_weights
from moc_jax.config import layer_plan, memory_layers
from moc_jax.train import step as step_lib
from tests.asserts import assert_same_bytes
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2,
         "memory.pkm_sub_keys": 4, "memory.pkm_top_k": 3}
IDS = np.random.default_rng(5).integers(0, 260, (2, 24)).astype(np.int32)


def save_base(directory, spec, overrides, seed):
  """A base run in `directory` (config.json, a weights checkpoint at step 7) whose parameters are all drawn; -> its
  parameters (numpy) and its logits on IDS from its own model."""
  config = moc_jax.load_config(spec, {**SMALL, **overrides})
  model = moc_jax.build_model(config, seed=seed)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(scale=0.1, size=x.shape), x.dtype),
                        nnx.state(model, nnx.Param))
  nnx.update(model, params)
  os.makedirs(directory)
  with open(os.path.join(directory, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  write_weights(os.path.join(directory, "checkpoints"), 7, params)
  return {"dir": str(directory), "config": config, "params": jax.tree.map(np.asarray, params.to_pure_dict()),
          "logits": np.asarray(model(jnp.asarray(IDS))[0])}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
  return save_base(tmp_path_factory.mktemp("dense") / "run", "configs/vanilla.py:tiny", {}, seed=3)


@pytest.fixture(scope="module")
def moc(tmp_path_factory):
  """A MoC base: chapters at layers 1 and 3, its W_o drawn like the rest, so its memory shows in its logits."""
  return save_base(tmp_path_factory.mktemp("moc") / "run", "configs/moc.py:tiny", {}, seed=4)


def config(base, overrides):
  return moc_jax.load_config("configs/moc.py:tiny", {**SMALL, "train.upscale_from": base["dir"], **overrides})


def upscaled(cfg):
  """(the up-scaled model's parameters as a fresh run starts it, its state layout, the base step read). The
  initial parameters are the model's as training initialises them (`layout.init` draws the same, compiled)."""
  mesh = sharding.make_mesh(cfg, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(cfg)):
    layout = state_lib.build_state(cfg, mesh)
    params = nnx.state(moc_jax.build_model(cfg, seed=cfg.seed), nnx.Param)
    params, step = upscale.upscaled_params(cfg, *upscale.base_run(cfg), mesh, params, layout.shardings["params"])
  return params, layout, step


def layer(params, cfg, i):
  """Layer i's block parameters (numpy): a scanned stack holds layer i at block i % period of group i // period."""
  plan = layer_plan(cfg)
  blocks = params["layers"]["blocks"]
  if not plan.scanned:
    return jax.tree.map(np.asarray, blocks[i])
  return jax.tree.map(lambda x: np.asarray(x)[i // plan.period], blocks[i % plan.period])


def without_memory(block):
  return {k: v for k, v in block.items() if k != "memory"}


HML = {"memory.kind": "hml", "memory.sharing": "per_layer"}
SPREAD = {"memory.placement": "spread", "memory.placement_k": 2}


def check_step_0(cfg, params, layout, base):
  """The up-scaled model's logits are the base model's; its blocks are the base's, and each inserted hml block's norm
  and q, k, v are those of the block it copies, bit for bit."""
  logits = nnx.merge(layout.graphdef, params)(jnp.asarray(IDS))[0]
  np.testing.assert_allclose(np.asarray(logits), base["logits"], rtol=1e-5, atol=1e-5)
  params = params.to_pure_dict()
  for i in range(cfg.model.num_layers):
    assert_same_bytes(*(without_memory(layer(p, c, i)) for p, c in ((params, cfg), (base["params"], base["config"]))))
  if cfg.memory.kind != "hml":
    return
  shift = 0 if cfg.train.upscale_copy == "next" else -1
  for i in memory_layers(cfg):
    mine, theirs = layer(params, cfg, i)["memory"], layer(base["params"], base["config"], i + shift)
    assert_same_bytes((mine["norm"], {n: mine["attn"][n] for n in "qkv"}),
                      (theirs["attn_norm"], {n: theirs["attn"][n] for n in "qkv"}))
    assert np.any(theirs["attn_norm"]["scale"] != 1.0)


@pytest.mark.parametrize("overrides, layers", [
    ({**HML, "memory.layer_indices": (0, 2)}, (0, 2)),                                  # scanned, before layer 0
    ({**HML, **SPREAD, "train.upscale_copy": "previous"}, (1, 3)),
    ({"memory.kind": "pkm", **SPREAD}, (1, 3)),
    pytest.param({**HML, **SPREAD}, (1, 3), marks=pytest.mark.slow),
    pytest.param({**HML, **SPREAD, "memory.sharing": "shared", "model.scan_layers": False}, (1, 3),
                 marks=pytest.mark.slow),
    pytest.param({"memory.kind": "chapters", "memory.layer_indices": (0, 2, 3)}, (0, 2, 3), marks=pytest.mark.slow),
], ids=["hml-0,2-next", "hml-spread-previous", "pkm-spread", "hml-spread-next", "hml-spread-unrolled-shared",
        "chapters-0,2,3"])
def test_step_0_logits_are_the_base_models(dense, overrides, layers):
  """(hml at explicit layers, copying the block before them, unrolled: the freeze test; chapter reads inserted into a
  MoC base: the next test.)"""
  cfg = config(dense, overrides)
  params, layout, step = upscaled(cfg)
  assert step == 7 and memory_layers(cfg) == layers
  check_step_0(cfg, params, layout, dense)


def test_memory_placement_spread_is_the_middle_of_equal_spans():
  def spread(layers, k):
    return memory_layers(moc_jax.load_config("configs/moc.py:tiny", {
        "model.num_layers": layers, "memory.placement": "spread", "memory.placement_k": k}))
  assert spread(4, 2) == (1, 3) and spread(16, 4) == (2, 6, 10, 14) and spread(4, 4) == (0, 1, 2, 3)


def test_a_moc_base_keeps_its_memory_and_bank(moc):
  cfg = config(moc, {"memory.layer_indices": (0, 1, 2, 3), "memory.sharing": "per_layer"})
  params, layout, _ = upscaled(cfg)
  check_step_0(cfg, params, layout, moc)  # chapter reads inserted at layers 0 and 2 (zero W_o) change nothing
  params = params.to_pure_dict()
  bank, base_bank = np.asarray(params["bank"]["memory"]), moc["params"]["bank"]["memory"]
  for i in (1, 3):  # layer i keeps its memory read, and reads table i: the base's one table
    assert_same_bytes(layer(params, cfg, i), layer(moc["params"], moc["config"], i))
    assert bank[i].tobytes() == base_bank[0].tobytes()
  assert np.any(bank[0] != base_bank[0])  # an inserted layer's own table: its initialisation


def test_freeze_base_keeps_every_base_parameter_and_trains_the_inserted_ones(dense):
  cfg = config(dense, {**HML, "memory.layer_indices": (1, 2), "train.upscale_copy": "previous",
                       "train.freeze_base": True, "train.weight_decay": 0.0, "train.schedule": "constant",
                       "train.warmup_steps": 0, "train.base_lr": 1e-2, "train.memory_lr": 1e-2})
  params, layout, _ = upscaled(cfg)
  check_step_0(cfg, params, layout, dense)
  start = jax.tree.map(np.asarray, params.to_pure_dict())
  # the initial state is zeros but for the parameters (`layout.init` compiles it)
  state = {**jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), layout.abstract), "params": params,
           "opt_state": layout.tx.init(params)}
  mesh = sharding.make_mesh(cfg, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(cfg)):
    data_sharding = sharding.data_sharding(cfg, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, cfg, layout.shardings, data_sharding)
    for s in range(3):
      state, metrics = step(state, jax.device_put(tu.random_batch(cfg, s), data_sharding))
      assert np.isfinite(float(metrics["loss"]))
  params = jax.tree.map(np.asarray, state["params"].to_pure_dict())
  base = dense["params"]
  assert_same_bytes((params["embed"], params["final_norm"]), (base["embed"], base["final_norm"]))
  for i in range(cfg.model.num_layers):
    assert_same_bytes(without_memory(layer(params, cfg, i)), layer(base, dense["config"], i))
  for i in (1, 2):  # every parameter of the inserted blocks, and each block's value table
    mine = jax.tree_util.tree_flatten_with_path(layer(params, cfg, i)["memory"])[0]
    for (path, new), old in zip(mine, jax.tree.leaves(layer(start, cfg, i)["memory"])):
      assert np.any(new != old), (i, jax.tree_util.keystr(path))
  assert np.any(params["bank"]["memory"] != start["bank"]["memory"], axis=(1, 2)).all()


@pytest.mark.parametrize("overrides, field", [
    ({"train.upscale_copy": "after"}, "config.train.upscale_copy"),
    ({"train.init_from": "/elsewhere"}, "config.train.upscale_from"),
    ({"memory.enabled": False, "memory.placement": "none"}, "config.train.upscale_from"),
    ({"memory.kind": "pkm", "memory.wo_init_zero": False}, "config.memory.wo_init_zero"),
    ({"memory.block_variant": "B"}, "config.memory.block_variant"),
])
def test_the_config_alone_names_the_bad_field(dense, overrides, field):
  with pytest.raises(moc_jax.ConfigError) as e:
    config(dense, overrides)
  assert str(e.value).startswith(field + ":") and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, field", [
    ({"model.d_model": 128}, "config.model.d_model"),
    ({"model.num_layers": 6}, "config.model.num_layers"),
    ({"model.vocab_size": 300}, "config.model.vocab_size"),
    ({**HML, "memory.layer_indices": (0, 2), "train.upscale_copy": "previous"}, "config.memory.layer_indices"),
    ({"train.upscale_from": "/nonexistent/run"}, "config.train.upscale_from"),
    ({"train.upscale_from": REPO}, "config.train.upscale_from"),   # a directory without config.json
])
def test_the_base_run_names_the_bad_field(dense, overrides, field):
  with pytest.raises(moc_jax.ConfigError) as e:
    upscale.base_run(config(dense, overrides))
  assert str(e.value).startswith(field + ":") and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, field", [
    ({**HML, "memory.layer_indices": (1, 3)}, "config.memory.kind"),
    ({"memory.layer_indices": (1, 2)}, "config.memory.layer_indices"),
    ({"memory.top_k": 4}, "config.memory.top_k"),
    ({"memory.layer_indices": (0, 1, 3), "train.freeze_base": True}, "config.train.freeze_base"),
])
def test_a_moc_base_names_the_bad_field(moc, overrides, field):
  with pytest.raises(moc_jax.ConfigError) as e:
    upscale.base_run(config(moc, overrides))
  assert str(e.value).startswith(field + ":") and "\n" not in str(e.value), str(e.value)


def test_the_command_refuses_an_incompatible_base_in_one_line(dense, tmp_path):
  before = sorted(os.walk(dense["dir"]))
  args = [f"--config.{k}={v}" for k, v in {**SMALL, **HML, "memory.layer_indices": "(1,2)", "model.d_model": 128,
                                           "train.upscale_from": dense["dir"]}.items()]
  out = subprocess.run([sys.executable, "-m", "moc_jax.main", "--config=configs/moc.py:tiny",
                        f"--workdir={tmp_path / 'up'}", *args], check=False, cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 2 and len(errors) == 1 and "config.model.d_model: 128" in errors[0], out.stderr
  assert sorted(os.walk(dense["dir"])) == before
