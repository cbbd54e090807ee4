"""The cluster tree (moc_jax/data/cluster_tree.py): the balance rule against a hand count, the greedy traversal against
a brute-force descent on hand-made points, purity and NMI against hand computations, and the tree on moc_facts."""
import math

import numpy as np

import moc_jax
from moc_jax.data import cluster_tree as ct
from moc_jax.data import facts


def test_balance_splits_the_largest_with_the_smallest_until_none_is_over_the_bound():
  """k = 4, 20 points, limit 1.5 x 20 / 4 = 7.5. By hand: sizes [14, 3, 2, 1] -> 0 and 3 share 15 points (8, 7):
  [8, 3, 2, 7] -> 0 and 2 share 10 (5, 5): [5, 3, 5, 7], all within 7.5."""
  assign = np.array([0] * 14 + [1] * 3 + [2] * 2 + [3])
  out = ct.balance(assign, 4, np.random.default_rng(0))
  assert np.bincount(out, minlength=4).tolist() == [5, 3, 5, 7]
  assert (out[assign == 1] == 1).all() and (out[assign != 1] != 1).all()  # cluster 1 never took part
  assert (ct.balance(np.array([0, 1, 2, 3, 0, 1]), 4, np.random.default_rng(0)) == [0, 1, 2, 3, 0, 1]).all()


def _hand_tree():
  """k = 2, two levels on a line: level 1 at 0 and 10; node 0's children at -1 and 1, node 1's at 4 and 12."""
  level1 = np.array([[0.0, 0], [10, 0]], np.float32)
  level2 = np.array([[-1.0, 0], [1, 0], [4, 0], [12, 0]], np.float32)
  return ct.Tree(2, (level1, level2))


def _brute_force_paths(tree, x):
  """Descend by computing every distance in float64, one point and one level at a time."""
  out = []
  for p in x.astype(np.float64):
    node, path = 0, []
    for centroids in tree.centroids:
      children = centroids.astype(np.float64)[node * tree.k:(node + 1) * tree.k]
      node = node * tree.k + int(np.argmin([((p - c) ** 2).sum() for c in children]))
      path.append(node)
    out.append(path)
  return np.array(out)


def test_traversal_is_the_greedy_descent():
  """4.5 is nearer 0 than 10 at level 1, so it ends at 1 (index 1), not at the nearest leaf 4 (index 2)."""
  tree = _hand_tree()
  x = np.array([[4.5, 0], [-3, 1], [11, -1], [6, 0], [0.2, 0]], np.float32)
  assert tree.paths(x).tolist() == [[0, 1], [0, 0], [1, 3], [1, 2], [0, 1]]
  rng = np.random.default_rng(0)
  y = rng.normal(0, 6, (200, 2)).astype(np.float32)
  np.testing.assert_array_equal(tree.paths(y), _brute_force_paths(tree, y))


def test_save_and_load_keep_the_tree(tmp_path):
  tree = _hand_tree()
  tree.save(tmp_path / "tree.npz")
  back = ct.Tree.load(tmp_path / "tree.npz")
  assert back.k == 2 and back.levels == 2
  for a, b in zip(back.centroids, tree.centroids, strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_node_with_fewer_points_than_children_gives_each_its_own():
  x = np.array([[0.0, 0], [5, 5]], np.float32)
  centroids = ct.fit_node(x, 4, np.random.default_rng(0))
  assert centroids.shape == (4, 2)
  assert ct.nearest(x, centroids).tolist() == [0, 1]
  assert ct.nearest(np.array([[6.0, 6]]), centroids).tolist() == [1]  # the repeats (2, 3) never win


def test_build_tree_separates_blobs_and_balances():
  """Four well separated blobs of 50 points, k = 4, one level: each blob is a cluster."""
  rng = np.random.default_rng(1)
  centres = np.array([[0, 0], [20, 0], [0, 20], [20, 20]], np.float32)
  x = np.concatenate([c + rng.normal(0, 1, (50, 2)) for c in centres]).astype(np.float32)
  labels = np.repeat(np.arange(4), 50)
  tree = ct.build_tree(x, 4, 1, seed=0)
  clusters = tree.paths(x)[:, 0]
  assert ct.purity(labels, clusters) == 1.0 and math.isclose(ct.nmi(labels, clusters), 1.0)
  assert np.bincount(clusters, minlength=4).tolist() == [50] * 4


def test_purity_and_nmi_against_hand_counts():
  labels = np.array([0, 0, 0, 1, 1, 1])
  clusters = np.array([5, 5, 7, 7, 7, 7])
  assert ct.purity(labels, clusters) == 5 / 6  # cluster 5: two 0s; cluster 7: three 1s of four
  # float64 by hand: joint p = [[2, 1], [0, 3]] / 6, marginals (1/2, 1/2) and (1/3, 2/3)
  joint = {(0, 0): 2 / 6, (0, 1): 1 / 6, (1, 1): 3 / 6}
  pl, pc = (0.5, 0.5), (1 / 3, 2 / 3)
  mi = sum(p * math.log(p / (pl[i] * pc[j])) for (i, j), p in joint.items())
  h = -sum(p * math.log(p) for p in pl) - sum(p * math.log(p) for p in pc)
  assert math.isclose(ct.nmi(labels, clusters), 2 * mi / h, rel_tol=1e-12)
  assert ct.nmi(labels, np.zeros(6)) == 0.0 and ct.purity(labels, np.zeros(6)) == 0.5


def test_embeddings_weigh_rare_words_and_ignore_order():
  texts = ["the cat sat", "sat the cat", "the dog ran", "the dog sat"]
  x = ct.embed_texts(texts, dim=64)
  assert x.shape == (4, 64) and x.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1, rtol=1e-6)
  np.testing.assert_array_equal(x[0], x[1])
  only_the = ct.embed_texts(["the", "the"], dim=64)  # a word in every document has idf 0: nothing to embed
  assert (only_the == 0).all()


def test_the_tree_finds_the_entities_of_moc_facts():
  """tiny's corpus (64 entities, Zipf) cut to 2,000 documents: at level 2 (256 leaves) nearly every leaf holds one
  entity's documents."""
  config = moc_jax.load_config("configs/moc.py:tiny", {"data.facts.num_docs": 2000})
  train = facts.generate(facts.MocFactsConfig.for_sizes(config.data.facts))["train"]
  labels = np.array([d["entity_rank"] for d in train])
  x = ct.embed_texts([d["text"] for d in train])
  paths = ct.build_tree(x, 16, 2, seed=0).paths(x)
  assert ct.purity(labels, paths[:, 1]) >= 0.95 and ct.nmi(labels, paths[:, 1]) >= 0.6
