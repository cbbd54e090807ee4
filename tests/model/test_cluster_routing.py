"""`memory.routing=cluster`: no router; each position reads the shared chapters and those owned by the nodes on its
document's cluster path (model/routing.py `cluster_chapters`), through the chapter read of the other per-position
modes. Hand counts of the chapter ids, the read's dependence on exactly those chapters, and the config's errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.config import chapters_read, cluster_ranges
from moc_jax.config.schema import GENERIC_PATH
from moc_jax.errors import ConfigError, DataError
from moc_jax.eval.routing import zero_chapters
from moc_jax.model.build import count_params
from moc_jax.model.routing import cluster_chapters, subtree_mask

# k = 4, two levels, 2 chapters per level-1 node and 1 per leaf: 1 shared + 2·4 + 1·16 = 25 chapters of 16 tokens
CLUSTER = {"model.compute_dtype": "float32", "memory.routing": "cluster", "data.cluster.k": 4,
           "data.cluster.levels": 2, "memory.cluster_chapters": (2, 1), "memory.num_chapters": 25,
           "memory.num_tokens": 400}


def _config(**overrides):
  return moc_jax.load_config("configs/moc.py:tiny", {**CLUSTER, **overrides})


def test_chapter_ids_of_a_path_by_hand():
  """Level 1 owns chapters 1..8 (node j: 1 + 2j, 2 + 2j), level 2 owns 9..24 (leaf j: 9 + j); shared 0 first.
  Path (1, 5): 3, 4 and 14. Path (3, 14): 7, 8 and 23. Padding (-1, -1) reads as node 0: 1, 2 and 9."""
  paths = jnp.array([[1, 5], [3, 14], [-1, -1], [0, 0]])
  ids = np.asarray(cluster_chapters(paths, 1, 4, (2, 1)))
  assert ids.tolist() == [[0, 3, 4, 14], [0, 7, 8, 23], [0, 1, 2, 9], [0, 1, 2, 9]]
  # no shared chapter, k = 4, (1, 0, 3): level 1 owns 0..3, level 2 none, level 3 4 + 3j .. 6 + 3j for leaf j
  no_shared = np.asarray(cluster_chapters(jnp.array([[2, 0, 63]]), 0, 4, (1, 0, 3)))
  assert no_shared.tolist() == [[2, 193, 194, 195]]
  assert chapters_read(_config()) == 4


def test_generic_chapters_by_hand():
  """With data.cluster.generic the bank holds, after the tree's 24 routable chapters, 3 generic ones (25, 26, 27):
  a GENERIC_PATH reads them instead of a path's, padding still reads node 0."""
  paths = jnp.array([[1, 5], [GENERIC_PATH, GENERIC_PATH], [-1, -1]])
  ids = np.asarray(cluster_chapters(paths, 1, 4, (2, 1), generic=True))
  assert ids.tolist() == [[0, 3, 4, 14], [0, 25, 26, 27], [0, 1, 2, 9]]
  assert cluster_ranges(1, 4, (2, 1), True) == ([(1, 9), (9, 25)], 25)
  assert cluster_ranges(0, 4, (1, 0, 3), False) == ([(0, 4), (4, 4), (4, 196)], None)
  config = _config(**{"data.cluster.generic": 0.2, "memory.num_chapters": 28, "memory.num_tokens": 448})
  assert chapters_read(config) == 4
  with pytest.raises(ConfigError, match="config.memory.num_chapters: .*3 generic ones.*set num_chapters=28"):
    _config(**{"data.cluster.generic": 0.2})


@pytest.fixture(scope="module")
def model():
  """Memory output projections drawn (not zero) so the bank reaches the logits."""
  model = moc_jax.build_model(_config(**{"memory.wo_init_zero": False}), seed=1)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda state, ids, mask, segments, paths: nnx.merge(graphdef, state)(
      ids, mask, segment_ids=segments, cluster_path=paths))
  return model, state, fwd


def _packed():
  """One packed row: a 5-token document on path (1, 5), a 4-token one on (3, 14), 3 padding slots."""
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
  segments = jnp.array([[1] * 5 + [2] * 4 + [0] * 3], jnp.int32)
  paths = jnp.array([[[1, 5]] * 5 + [[3, 14]] * 4 + [[-1, -1]] * 3], jnp.int32)
  return ids, (segments > 0).astype(jnp.int32), segments, paths


def test_each_position_reads_its_documents_path(model):
  _, state, fwd = model
  _, aux = fwd(state, *_packed())
  chapters, weights = np.asarray(aux["chapters"]), np.asarray(aux["weights"])
  assert chapters.shape == (2, 1, 12, 4)  # two memory layers, every position its own 1 + 2 + 1 chapters
  assert (chapters[:, 0, :5] == [0, 3, 4, 14]).all() and (chapters[:, 0, 5:9] == [0, 7, 8, 23]).all()
  np.testing.assert_allclose(weights[0, 0, 0], [1 / 3.5] + [2.5 / 3 / 3.5] * 3, rtol=1e-6)  # a uniform router's mix
  load = np.zeros(25)
  load[[3, 4, 14]], load[[7, 8, 23]] = 5, 4  # routed reads of the real positions
  np.testing.assert_array_equal(np.asarray(aux["load"]), [load, load])
  assert float(aux["router_loss"]) == 0.0


def assert_rows_reach_their_paths_alone(state, fwd):
  """On `_packed`'s row, zeroing bank row r (a chapter, or an FFN column: the same layout of 25) changes the logits of
  exactly the documents whose path owns r; the shared row 0 changes every real position; rows on no real
  position's path change nothing."""
  batch = _packed()
  base = np.asarray(fwd(state, *batch)[0])

  def without(row):
    mask = np.zeros((1, 25), bool)
    mask[0, row] = True
    return np.abs(np.asarray(fwd(zero_chapters(state, mask), *batch)[0]) - base).max(-1)[0]

  first, second = slice(0, 5), slice(5, 9)
  for row, changed in ((3, first), (14, first), (8, second), (23, second)):
    diff = without(row)
    other = second if changed == first else first
    assert diff[changed].max() > 0 and diff[other].max() == 0, row
  for row in (1, 2, 9, 13, 24):  # on no real position's path
    assert without(row)[:9].max() == 0, row
  assert (without(0)[:9] > 0).all()


def test_the_read_depends_on_the_paths_chapters_alone(model):
  _, state, fwd = model
  assert_rows_reach_their_paths_alone(state, fwd)


def test_no_router_parameters():
  config = _config()
  model = moc_jax.build_model(config)
  names = [".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  assert not [n for n in names if "router" in n]
  routed = moc_jax.load_config("configs/moc.py:tiny", {"memory.num_chapters": 25, "memory.num_tokens": 400})
  router = 2 * (64 + 1) * 25  # two memory layers' [d, C] matrices and biases
  assert count_params(routed)["memory_layers"] - count_params(config)["memory_layers"] == router


def test_a_call_without_paths_is_refused(model):
  m, _, _ = model
  with pytest.raises(ValueError, match="cluster_path"):
    m(jnp.ones((1, 4), jnp.int32))


def test_subtree_chapters_by_hand():
  """k = 4, (4, 3) after 1 shared chapter: level-0 node j owns 1 + 4j .. 4 + 4j, leaf j owns 17 + 3j .. 19 + 3j, and
  leaves 4j .. 4j + 3 lie below node j. Path (1, 5) may choose 0, 5..8 and 29..40; (3, 14) 0, 13..16 and 53..64;
  padding (-1, -1) reads as node 0."""
  mask = np.asarray(subtree_mask(jnp.array([[1, 5], [3, 14], [-1, -1]]), 1, 4, (4, 3), 65))
  chosen = [np.flatnonzero(row).tolist() for row in mask]
  assert chosen == [[0, *range(5, 9), *range(29, 41)], [0, *range(13, 17), *range(53, 65)],
                    [0, *range(1, 5), *range(17, 29)]]
  # (2, 0, 1) on a 2-ary tree, no shared chapter: node 1 owns 2, 3; level 1 none; leaf j owns 4 + j, and the
  # leaves 4..7 below node 1 own 8..11
  assert np.flatnonzero(np.asarray(subtree_mask(jnp.array([1, 3, 6]), 0, 2, (2, 0, 1), 12))).tolist() == [
      2, 3, 8, 9, 10, 11]


def test_subtree_routing_chooses_within_the_documents_subtree():
  """The learned router's top-8 of every position (a packed row: two documents on two subtrees) lies in its
  document's subtree; the router's statistics are a prefix router's."""
  config = moc_jax.load_config("configs/moc.py:tiny", {
      "model.compute_dtype": "float32", "memory.routing": "subtree", "data.cluster.k": 4,
      "memory.cluster_chapters": (4, 3)})
  model = moc_jax.build_model(config, seed=2)
  ids, mask, segments, _ = _packed()
  paths = jnp.array([[[1, 5]] * 5 + [[3, 14]] * 4 + [[-1, -1]] * 3], jnp.int32)
  _, aux = model(ids, mask, segment_ids=segments, cluster_path=paths)
  chapters = np.asarray(aux["chapters"])  # [2 layers, 1, 12, 1 + 8]
  assert chapters.shape == (2, 1, 12, 9) and (chapters[..., 0] == 0).all()
  first, second = {*range(5, 9), *range(29, 41)}, {*range(13, 17), *range(53, 65)}
  assert set(chapters[:, 0, :5, 1:].ravel()) <= first and set(chapters[:, 0, 5:9, 1:].ravel()) <= second
  assert float(aux["router_loss"]) > 0 and aux["load"].shape == (2, 65)
  with pytest.raises(ValueError, match="cluster_path"):
    model(ids, mask, segment_ids=segments)


@pytest.mark.parametrize("overrides, field", [
    ({"memory.routing": "subtree", "memory.router": "product"}, "memory.router"),
    ({"memory.routing": "subtree", "memory.top_k": 17, "memory.cluster_chapters": (4, 3), "memory.num_chapters": 65,
      "memory.num_tokens": 1040}, "memory.top_k"),
    ({"memory.routing": "subtree", "data.cluster.generic": 0.2}, "data.cluster.generic"),
    ({"memory.routing": "subtree", "data.cluster.k": 0}, "data.cluster.k"),
    ({"data.cluster.k": 0}, "data.cluster.k"),
    ({"memory.cluster_chapters": (2,)}, "memory.cluster_chapters"),
    ({"memory.cluster_chapters": (2, -1)}, "memory.cluster_chapters"),
    ({"memory.cluster_chapters": (0, 0)}, "memory.cluster_chapters"),
    ({"memory.num_chapters": 26, "memory.num_tokens": 416}, "memory.num_chapters"),
    ({"memory.routing_pool": "attention"}, "memory.routing_pool"),
    ({"memory.load_balance": "aux_free"}, "memory.load_balance"),
    ({"data.cluster.generic": 1.0}, "data.cluster.generic"),
    ({"data.cluster.generic": -0.1}, "data.cluster.generic")])
def test_config_errors_name_the_field(overrides, field):
  with pytest.raises((ConfigError, DataError), match=f"config.{field}:"):
    _config(**overrides)
