"""Whole-model facts: parameter counts, shapes without allocation, scan/unroll equivalence, init, metadata."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.config import memory_layers

from tests.conftest import Compiled, F32


@pytest.fixture(scope="module")
def paper_cfg():
  return moc_jax.load_config("configs/moc.py:262k")


def test_count_params_paper(paper_cfg):
  """The paper's figures (published parameter counts)."""
  assert moc_jax.count_params(paper_cfg) == {
      "total": 371_292_932, "backbone": 147_874_560, "bank": 201_375_744, "memory_layers": 22_042_628}
  iso = moc_jax.count_params(moc_jax.load_config("configs/vanilla.py:iso"))
  assert iso == {"total": 202_937_088, "backbone": 202_937_088, "bank": 0, "memory_layers": 0}
  assert moc_jax.count_params(moc_jax.load_config("configs/vanilla.py:backbone"))["total"] == 147_874_560


def _hand_count(c):
  """Independent count from the architecture: tied embedding, GQA attention, SwiGLU, 2 norms per layer,
  final norm; per memory layer q/k/v/o + norm + router (weight and bias); one bank per bank id."""
  m, mem = c.model, c.memory
  d, hd = m.d_model, m.d_model // m.num_heads
  kv = m.num_kv_heads * hd
  layer = 2 * d * d + 2 * d * kv + 3 * d * m.mlp_dim + 2 * d
  backbone = m.vocab_size * d + m.num_layers * layer + d
  n_mem = len(memory_layers(c))
  if not n_mem:
    return {"total": backbone, "backbone": backbone, "bank": 0, "memory_layers": 0}
  md = mem.dim or d
  mkv = mem.num_kv_heads * (d // mem.num_heads)
  per_mem = d * d + 2 * md * mkv + d * d + d + d * mem.num_chapters + mem.num_chapters
  if mem.block_variant == "B":
    per_mem += 3 * d * m.mlp_dim + d  # post-memory norm and SwiGLU
  n_banks = {"shared": 1, "per_layer": n_mem, "every_k_layers": -(-n_mem // mem.sharing_k)}[mem.sharing]
  bank = n_banks * mem.num_tokens * md
  return {"total": backbone + bank + n_mem * per_mem, "backbone": backbone, "bank": bank,
          "memory_layers": n_mem * per_mem}


@pytest.mark.parametrize("overrides", [
    {},
    {"memory.sharing": "per_layer"},
    {"memory.sharing": "every_k_layers", "memory.sharing_k": 2, "memory.placement": "all"},
    {"memory.block_variant": "B", "memory.num_kv_heads": 2, "memory.dim": 48},
    {"model.scan_layers": False, "memory.layer_indices": (0, 1, 3)},
])
def test_count_params_tiny_by_hand(overrides):
  c = moc_jax.load_config("configs/moc.py:tiny", overrides)
  assert moc_jax.count_params(c) == _hand_count(c)


def test_count_params_vanilla_tiny_by_hand():
  c = moc_jax.load_config("configs/vanilla.py:tiny")
  assert moc_jax.count_params(c) == _hand_count(c)


def test_paper_model_abstract_forward(paper_cfg):
  """The 262k model and its forward at 2 x 64 are shape-checked without allocating any array."""
  model = moc_jax.abstract_model(paper_cfg)
  graphdef, state = nnx.split(model)
  leaves = jax.tree.leaves(state)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  ids = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  logits, aux = jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
  assert logits.shape == (2, 64, 49152) and logits.dtype == jnp.float32
  n_mem, sel = 4, 1 + 64
  assert aux["router_loss"].shape == ()
  for k in ("load_balance", "z_loss", "mse_aux", "entropy"):
    assert aux[k].shape == (n_mem,), k
  assert aux["chapters"].shape == (n_mem, 2, sel) and aux["weights"].shape == (n_mem, 2, sel)


def test_paper_model_params_carry_logical_axes(paper_cfg):
  """Every parameter names one logical axis per dimension (the mesh mapping is applied elsewhere)."""
  state = nnx.state(moc_jax.abstract_model(paper_cfg), nnx.Param)
  flat = list(nnx.to_flat_state(state))
  assert len(flat) > 10
  for path, var in flat:
    names = var.get_metadata().get("out_sharding")
    assert names is not None, path
    assert len(names) == len(var.shape), (path, names, var.shape)
    assert all(isinstance(n, str) for n in names), (path, names)
    if path[0] == "layers":  # scanned stack: leading axis of size num_groups
      assert names[0] == "layers" and var.shape[0] == 4, (path, names)


def test_tiny_model_runs_with_mocpt_routing(moc_tiny_mocpt_routing):
  """One decision per row and MoC-PT's router losses at init."""
  cfg = moc_tiny_mocpt_routing.cfg
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.model.vocab_size, (2, 16))
  logits, aux = moc_tiny_mocpt_routing(ids)
  logits = np.asarray(logits)
  assert logits.shape == (2, 16, cfg.model.vocab_size) and np.isfinite(logits).all()
  n_mem, s, k = 2, cfg.memory.num_shared, cfg.memory.top_k
  for key in ("load_balance", "z_loss", "mse_aux", "entropy"):
    assert aux[key].shape == (n_mem,) and np.isfinite(np.asarray(aux[key])).all(), key
  chapters, weights = np.asarray(aux["chapters"]), np.asarray(aux["weights"])
  assert chapters.shape == weights.shape == (n_mem, 2, s + k)
  assert (chapters[..., 0] == 0).all() and (chapters[..., 1:] >= 1).all()
  assert all(len(set(row)) == s + k for row in chapters.reshape(-1, s + k))
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(weights[..., 0], 1 / 3.5, rtol=1e-5)
  # router_loss = mean over memory layers of 0.01 LB + 0.001 Z (+ 0 MSE)
  lb, z = np.asarray(aux["load_balance"], np.float64), np.asarray(aux["z_loss"], np.float64)
  np.testing.assert_allclose(float(aux["router_loss"]), np.mean(0.01 * lb + 0.001 * z), rtol=1e-5)
  # near-uniform router at init: LB ~ k and Z ~ ln(C)^2 (MoC-PT's losses)
  np.testing.assert_allclose(lb, k, rtol=0.05)
  np.testing.assert_allclose(z, np.log(cfg.memory.num_chapters) ** 2, rtol=0.02)


def test_vanilla_tiny_aux(vanilla_tiny):
  logits, aux = vanilla_tiny(np.zeros((2, 16), np.int32))
  assert set(aux) == {"router_loss"} and float(aux["router_loss"]) == 0.0
  assert np.isfinite(np.asarray(logits)).all()


def test_scanned_equals_unrolled(moc_tiny):
  """Unrolled layer i = g * period + j holds group g's slice of the scanned layers.blocks[j]."""
  cfg = moc_tiny.cfg
  period = 2
  unrolled = Compiled("configs/moc.py:tiny", {"model.scan_layers": False}, seed=5)
  assert not unrolled.model.plan.scanned and moc_tiny.model.plan.scanned

  # randomise the zero memory W_o so the memory path contributes to the comparison
  scanned_model = nnx.clone(moc_tiny.model)
  o = scanned_model.layers.blocks[1].memory.attn.o.kernel
  o.value = 0.05 * jax.random.normal(jax.random.key(1), o.value.shape)
  scanned_state = nnx.split(scanned_model)[1]

  src = {path: var for path, var in nnx.to_flat_state(scanned_state)}
  filled, used = [], set()
  for path, var in nnx.to_flat_state(unrolled.state):
    if path[:2] == ("layers", "blocks"):
      i = path[2]
      g, j = divmod(i, period)
      key = path[:2] + (j,) + path[3:]
      value = src[key].get_value()[g]
      used.add(key)
    else:
      key = path
      value = src[key].get_value()
      used.add(key)
    assert value.shape == var.get_value().shape, path
    filled.append((path, var.replace(value)))
  assert used == set(src)  # every scanned parameter was mapped
  state = nnx.from_flat_state(filled)

  ids = np.random.default_rng(3).integers(0, cfg.model.vocab_size, (2, 16))
  a_logits, a_aux = moc_tiny(ids, state=scanned_state)
  b_logits, b_aux = unrolled(ids, state=state)
  assert np.abs(np.asarray(a_logits) - np.asarray(moc_tiny(ids)[0])).max() > 1e-4  # memory path is live
  np.testing.assert_allclose(np.asarray(b_logits), np.asarray(a_logits), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(b_aux["chapters"]), np.asarray(a_aux["chapters"]))
  for k in ("weights", "load_balance", "z_loss", "router_loss"):
    np.testing.assert_allclose(np.asarray(b_aux[k]), np.asarray(a_aux[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_init_statistics():
  """MoC-PT's initialisation: N(0, 0.02) everywhere, 0.00378 for self-attn W_o and MLP W_down, zero memory W_o,
  zero router bias, unit norm scales (a mid-size model; the 262k one is too big to allocate here)."""
  cfg = moc_jax.load_config("configs/moc.py:small", F32)
  params = nnx.to_flat_state(nnx.state(moc_jax.build_model(cfg, seed=3), nnx.Param))
  groups = {}
  for path, var in params:
    name = "/".join(str(p) for p in path if not isinstance(p, int))
    groups.setdefault(name, []).append(np.asarray(var.get_value(), np.float64).ravel())
  groups = {k: np.concatenate(v) for k, v in groups.items()}
  expected_std = {
      "layers/blocks/attn/o/kernel": 0.00378, "layers/blocks/mlp/down/kernel": 0.00378,
      "layers/blocks/attn/q/kernel": 0.02, "layers/blocks/attn/k/kernel": 0.02,
      "layers/blocks/mlp/gate/kernel": 0.02, "layers/blocks/mlp/up/kernel": 0.02,
      "layers/blocks/memory/attn/q/kernel": 0.02, "layers/blocks/memory/attn/v/kernel": 0.02,
      "layers/blocks/memory/router/proj/kernel": 0.02, "embed/embedding": 0.02, "bank/memory": 0.02,
  }
  for name, std in expected_std.items():
    x = groups[name]
    assert x.size > 10_000, name
    np.testing.assert_allclose(x.std(), std, rtol=0.03, err_msg=name)
    assert abs(x.mean()) < 4 * std / np.sqrt(x.size), name
  assert (groups["layers/blocks/memory/attn/o/kernel"] == 0).all()
  assert (groups["layers/blocks/memory/router/proj/bias"] == 0).all()
  scales = [k for k in groups if k.endswith("scale")]
  assert {"final_norm/scale", "layers/blocks/attn_norm/scale", "layers/blocks/mlp_norm/scale",
          "layers/blocks/memory/norm/scale"} <= set(scales)
  for k in scales:
    assert (groups[k] == 1).all(), k


MESH_NAMES = re.compile(r"""(['"])(data|fsdp|tensor)\1|jax\.sharding\.Mesh|PartitionSpec""")


def test_model_code_names_no_mesh_axes():
  """Model code uses logical axis names only; mesh axes belong to the sharding rules."""
  root = pathlib.Path(moc_jax.__file__).parent / "model"
  files = sorted(root.rglob("*.py"))
  assert files
  hits = [f"{f.name}:{n}: {line.strip()}" for f in files
          for n, line in enumerate(f.read_text().splitlines(), 1) if MESH_NAMES.search(line)]
  assert not hits, hits


def test_remat_works_on_a_model_merged_outside_a_jax_loop():
  """Greedy decoding merges the model once and calls it in a fori_loop; remat must not mutate it."""
  outs, ids = [], np.random.default_rng(0).integers(0, 260, (2, 16))
  for remat in ("full", "none"):
    cfg = moc_jax.load_config("configs/moc.py:tiny", {"model.num_layers": 2, "memory.layer_indices": (1,),
                                                      "model.remat": remat, "model.compute_dtype": "float32"})
    graphdef, params = nnx.split(moc_jax.build_model(cfg, 0), nnx.Param)

    def run(p, ids):
      model = nnx.merge(graphdef, p)
      return jax.lax.fori_loop(0, 2, lambda i, acc: acc + model(ids)[0], jnp.zeros((2, 16, 260)))

    outs.append(np.asarray(jax.jit(run)(params, ids)))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
