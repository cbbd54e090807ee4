"""`memory.kind=ffn` (model/ffn_memory.py): SwiGLU columns fetched by the document's cluster path widen a memory
layer's MLP. Against a float64 numpy restatement of the widened MLP, the backbone it starts as (down vectors zero),
hand counts of the columns a path fetches, the read's dependence on exactly those columns, FLOPs and parameter
counts by hand, and the config's errors. Sharded equals one device: tests/model/test_value_table.py (@slow)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import flops
from moc_jax.errors import ConfigError
from moc_jax.model.build import count_params
from moc_jax.model.ffn_memory import column_sum
from tests.model.test_cluster_routing import _packed, assert_rows_reach_their_paths_alone

# k = 4, two levels, 2 columns per level-1 node and 1 per leaf: 1 shared + 2·4 + 1·16 = 25 columns (d 64)
FFN = {"model.compute_dtype": "float32", "memory.kind": "ffn", "memory.routing": "cluster", "data.cluster.k": 4,
       "data.cluster.levels": 2, "memory.cluster_chapters": (2, 1), "memory.num_chapters": 25}


def _config(**overrides):
  return moc_jax.load_config("configs/moc.py:tiny", {**FFN, **overrides})


def _silu(z):
  return z / (1 + np.exp(-z))


def test_column_sum_is_the_widened_mlp_in_float64():
  """column_sum(x, ids) = the part of an MLP whose inner dimension holds the fetched columns: silu(x G) * (x U) D
  with G, U, D the columns' gate, up and down vectors, computed here in float64 per position."""
  rng = np.random.default_rng(0)
  table = rng.normal(size=(9, 3, 8)).astype(np.float32)
  x = rng.normal(size=(2, 5, 8)).astype(np.float32)
  ids = rng.integers(0, 9, (2, 5, 3)).astype(np.int32)
  got = np.asarray(column_sum(jnp.asarray(table), jnp.asarray(x), jnp.asarray(ids)))
  t, xs = table.astype(np.float64), x.astype(np.float64)
  want = np.zeros((2, 5, 8))
  for b in range(2):
    for p in range(5):
      g, u, d = (t[ids[b, p], j] for j in range(3))  # [S, 8] each
      want[b, p] = (_silu(g @ xs[b, p]) * (u @ xs[b, p])) @ d
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_at_init_the_model_is_its_backbone():
  """The down vectors start at zero: with the backbone's parameters the ffn model's logits are the model without
  memory's, bit for bit, whatever the paths. (Both unrolled, so their layers have the same names; an ffn memory
  layer holds no parameter of its own.)"""
  ffn = moc_jax.build_model(_config(**{"model.scan_layers": False}), seed=3)
  plain = moc_jax.build_model(moc_jax.load_config("configs/moc.py:tiny", {
      "model.compute_dtype": "float32", "model.scan_layers": False, "memory.enabled": False}), seed=0)
  backbone = nnx.state(ffn, nnx.Param)
  del backbone["bank"]
  nnx.update(plain, backbone)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 12)), jnp.int32)
  paths = jnp.asarray(np.random.default_rng(2).integers(0, 4, (2, 12, 2)) * [1, 4], jnp.int32)
  bank = np.asarray(ffn.bank.memory[...])
  assert not bank[..., 2, :].any() and bank[..., :2, :].std() > 0  # down zero, gate and up drawn
  np.testing.assert_array_equal(np.asarray(ffn(ids, cluster_path=paths)[0]), np.asarray(plain(ids)[0]))


@pytest.fixture(scope="module")
def model():
  """Down vectors drawn (not zero) so the columns reach the logits."""
  model = moc_jax.build_model(_config(), seed=1)
  bank = model.bank.memory
  bank.set_value(jax.random.normal(jax.random.key(5), bank.shape) * 0.3)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda state, ids, mask, segments, paths: nnx.merge(graphdef, state)(
      ids, mask, segment_ids=segments, cluster_path=paths))
  return state, fwd


def test_each_position_fetches_its_documents_columns(model):
  """Shared column 0, level 1's node j owns 1 + 2j and 2 + 2j, leaf j owns 9 + j: path (1, 5) fetches 0, 3, 4, 14
  and (3, 14) fetches 0, 7, 8, 23; `load` counts the path-owned columns' reads over the real positions."""
  state, fwd = model
  _, aux = fwd(state, *_packed())
  columns = np.asarray(aux["chapters"])
  assert columns.shape == (2, 1, 12, 4)
  assert (columns[:, 0, :5] == [0, 3, 4, 14]).all() and (columns[:, 0, 5:9] == [0, 7, 8, 23]).all()
  load = np.zeros(25)
  load[[3, 4, 14]], load[[7, 8, 23]] = 5, 4
  np.testing.assert_array_equal(np.asarray(aux["load"]), [load, load])
  assert float(aux["router_loss"]) == 0.0


def test_the_output_depends_on_the_paths_columns_alone(model):
  """Zeroing a column changes the logits of exactly the documents whose path owns it (the shared one: all)."""
  state, fwd = model
  assert_rows_reach_their_paths_alone(state, fwd)


def test_parameters_and_flops_by_hand():
  """Bank: 25 columns x 3 vectors x d 64, one table (memory.sharing=shared); no other memory parameter. FLOPs per
  memory layer per token: 4 columns, each 2 x 64 for the gate and the up product and 2 x 64 for the down one, 5 for
  its SwiGLU, and 64 adds into the MLP's output."""
  config = _config()
  counts = count_params(config)
  assert counts["bank"] == 25 * 3 * 64 and counts["memory_layers"] == 0
  plain = moc_jax.load_config("configs/moc.py:tiny", {"memory.enabled": False})
  assert counts["backbone"] == count_params(plain)["total"]
  e = flops.estimate(config, batch=1, seq_len=10)
  assert e["memory_layer"]["memory"]["total"] == 10 * (4 * (3 * 2 * 64 + 5) + 64)
  assert e["selected_memory_tokens"] == 10 * 4


@pytest.mark.parametrize("overrides, field", [
    ({"memory.routing": "prefix"}, "memory.routing"),
    ({"memory.block_variant": "B"}, "memory.block_variant"),
    ({"model.hidden_activation": "gelu"}, "model.hidden_activation"),  # the columns widen a SwiGLU MLP
    ({"memory.num_chapters": 26}, "memory.num_chapters"),
    ({"memory.cluster_chapters": (0, 0)}, "memory.cluster_chapters"),
    ({"data.cluster.k": 0}, "data.cluster.k")])
def test_config_errors_name_the_field(overrides, field):
  with pytest.raises(ConfigError, match=f"config.{field}:"):
    _config(**overrides)
