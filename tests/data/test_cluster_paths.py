"""Cluster paths in the batch (data/cluster_paths.py, data/pipeline.py): every token carries the path of its own
document's text through each layout, -1 on padding; `prefix` paths follow the text up to the token; the tree is
cached by its parameters; the iterator resumes exactly."""
import json
import os
import threading

import numpy as np
import pytest

from moc_jax.config.schema import GENERIC_PATH
from moc_jax.data import make_eval_batches, make_train_iterator
from moc_jax.data import cluster_paths
from moc_jax.data.cache_lock import exclusive
from moc_jax.data.cluster_paths import ClusterIndex, cluster_index, generic_paths, index_path
from moc_jax.data.cluster_tree import Embedder
from moc_jax.data.facts import MocFactsConfig, generate
from moc_jax.data.sources import open_source
from moc_jax.errors import DataError
from tests.data.test_facts import biography as biography_facts
from tests.data.test_pipeline import BYTE
from tests.data.test_pipeline import _config as pipeline_config


def _config(data_dir, **overrides):
  """256-token rows: every moc_facts document fits one whole, so a row's documents can be read back."""
  c = pipeline_config(data_dir, seq_len=256)
  c.cluster.update(k=4, levels=2)
  c.update(overrides)
  return c


def _documents(batch):
  """(row, its positions, the document's text) of every document of a batch, by segment (or the row's mask)."""
  out = []
  for row in range(len(batch["input_ids"])):
    segments = batch["segment_ids"][row] if "segment_ids" in batch else batch["attention_mask"][row]
    for s in np.unique(segments[segments > 0]):
      where = np.flatnonzero(segments == s)
      out.append((row, where, BYTE.decode(batch["input_ids"][row, where])))
  return out


@pytest.mark.parametrize("layout", ["pack_whole", "pad_truncate"])
def test_every_token_carries_its_own_documents_path(data_dir, layout):
  c = _config(data_dir, layout=layout)
  index = cluster_index(c, BYTE)
  it = make_train_iterator(c)
  for _ in range(3):
    batch = next(it)
    assert batch["cluster_path"].shape == (4, 256, 2) and batch["cluster_path"].dtype == np.int32
    docs = _documents(batch)
    assert len(docs) > 4 or layout == "pad_truncate"
    for row, where, text in docs:
      np.testing.assert_array_equal(batch["cluster_path"][row, where], np.repeat(index([text]), len(where), 0))
    assert (batch["cluster_path"][batch["attention_mask"] == 0] == -1).all()
    assert (batch["cluster_path"][batch["attention_mask"] == 1] >= 0).all()


def test_generic_documents_read_the_generic_chapters_whole(data_dir):
  """data.cluster.generic = 0.5: every training document carries either its own path or GENERIC_PATH at every token
  (padding -1 either way), about half of them the latter; evaluation's `generic` mode puts every document there; a
  resumed iterator draws the same coins."""
  c = _config(data_dir, layout="pack_whole")
  c.cluster.generic = 0.5
  index = cluster_index(c, BYTE)
  it = make_train_iterator(c)
  kinds = []
  for _ in range(12):
    batch = next(it)
    for row, where, text in _documents(batch):
      path = batch["cluster_path"][row, where]
      generic = (path == GENERIC_PATH).all()
      if not generic:
        np.testing.assert_array_equal(path, np.repeat(index([text]), len(where), 0))
      kinds.append(generic)
    assert (batch["cluster_path"][batch["attention_mask"] == 0] == -1).all()
  n = len(kinds)
  assert n > 80 and abs(np.mean(kinds) - 0.5) < 4 * (0.25 / n) ** 0.5  # a binomial share within 4 standard errors
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it)["cluster_path"] for _ in range(2)]
  resumed = make_train_iterator(c)
  resumed.set_state(state)
  for a in expected:
    np.testing.assert_array_equal(a, next(resumed)["cluster_path"])
  batch = next(make_eval_batches(c, paths="generic"))
  real = batch["attention_mask"] == 1
  assert (batch["cluster_path"][real] == GENERIC_PATH).all() and (batch["cluster_path"][~real] == -1).all()
  assert not (next(make_eval_batches(c))["cluster_path"][real] == GENERIC_PATH).any()  # evaluation never draws


def test_generic_coins_follow_the_global_stream():
  """An element's coin depends on the data seed and its place in the global stream: the same element read by one
  process (index g) or by process g % 2 of two (index g // 2) draws the same coin; another seed draws others."""
  element = {"cluster_path": np.zeros((3, 2), np.int32)}

  def generic(index, process_index=0, process_count=1, seed=0):
    out = generic_paths(index, element, probability=0.3, seed=seed, process_index=process_index,
                        process_count=process_count)
    return bool((out["cluster_path"] == GENERIC_PATH).all())

  one = [generic(g) for g in range(400)]
  two = [generic(g // 2, g % 2, 2) for g in range(400)]
  assert one == two and abs(np.mean(one) - 0.3) < 4 * (0.21 / 400) ** 0.5
  assert one != [generic(g, seed=1) for g in range(400)]
  assert generic_paths(0, None, probability=0.3, seed=0, process_index=0, process_count=1) is None


def test_pack_splits_a_path_with_its_document(data_dir):
  """`pack` cuts documents at row ends: each piece is a segment of its own, every token of it on one path."""
  batch = next(make_train_iterator(_config(data_dir, layout="pack", seq_len=64)))
  for row, where, _ in _documents(batch):
    assert (batch["cluster_path"][row, where] == batch["cluster_path"][row, where[0]]).all()


def test_prefix_paths_follow_the_text_up_to_each_token(data_dir):
  c = _config(data_dir, layout="pad_truncate")
  index = cluster_index(c, BYTE)
  document = next(make_eval_batches(c))
  prefix = next(make_eval_batches(c, paths="prefix"))
  n = int(prefix["attention_mask"][0].sum())
  ids = prefix["input_ids"][0, :n]
  np.testing.assert_array_equal(prefix["cluster_path"][0, :n], index([BYTE.decode(ids[:t + 1]) for t in range(n)]))
  np.testing.assert_array_equal(prefix["cluster_path"][0, n - 1], document["cluster_path"][0, 0])
  assert (prefix["cluster_path"][0, :n] != prefix["cluster_path"][0, n - 1]).any()  # the name moves it


@pytest.mark.parametrize("layout, skip", [("pack_whole", 3), ("pad_truncate", 5), ("pack", 2)])
def test_resume_restores_the_paths_exactly(data_dir, layout, skip):
  c = _config(data_dir, layout=layout)
  it = make_train_iterator(c)
  for _ in range(skip):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  resumed = make_train_iterator(c)
  resumed.set_state(state)
  for a, b in zip(expected, [next(resumed) for _ in range(3)]):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_tree_is_cached_by_its_parameters(data_dir):
  c = _config(data_dir)
  path = index_path(c, BYTE)
  first = cluster_index(c, BYTE)
  mtime = os.stat(path).st_mtime_ns
  again = cluster_index(c, BYTE)
  assert os.stat(path).st_mtime_ns == mtime  # read back, not fitted again
  texts = ["Mira Tolven was born in Karsk.", "an unrelated line"]
  np.testing.assert_array_equal(first(texts), again(texts))
  assert len({index_path(_config(data_dir, cluster={"k": k, "levels": levels, "seed": seed}), BYTE)
              for k, levels, seed in ((4, 2, 0), (8, 2, 0), (4, 1, 0), (4, 2, 1))}) == 4
  other = _config(data_dir)
  other.facts.seed = 1
  assert index_path(other, BYTE) != path
  assert cluster_index(_config(data_dir, cluster={"k": 0}), BYTE) is None


def test_index_save_and_load_keep_its_paths(data_dir, tmp_path):
  index = cluster_index(_config(data_dir), BYTE)
  index.save(tmp_path / "index.npz")
  back = ClusterIndex.load(tmp_path / "index.npz")
  assert back.embedder == index.embedder and back.levels == 2
  texts = [f"entity {i} works as a baker" for i in range(20)]
  np.testing.assert_array_equal(back(texts), index(texts))


def test_a_given_tree_is_used_as_it_is_on_other_data(data_dir, tmp_path):
  """data.cluster.tree: corpus B (facts seed 1) traversed by corpus A's tree, no tree fitted on B; a tree of other
  k or levels, and a file that is no tree, are one DataError naming the field."""
  tree_a = index_path(_config(data_dir), BYTE)
  index_a = cluster_index(_config(data_dir), BYTE)
  b = _config(data_dir, cluster={"tree": tree_a})
  b.facts.seed = 1
  texts = [f"entity {i} was born in Karsk and works as a baker" for i in range(20)]
  np.testing.assert_array_equal(cluster_index(b, BYTE)(texts), index_a(texts))
  assert not os.path.exists(index_path(_config(data_dir, facts={**b.facts.to_dict(), "seed": 1}), BYTE))
  with pytest.raises(DataError, match=r"config.data.cluster.tree=.* is a tree of k=4, 2 levels, words=0, and the "
                                      r"config asks k=8, 2, words=0"):
    cluster_index(_config(data_dir, cluster={"tree": tree_a, "k": 8}), BYTE)
  (tmp_path / "bad.npz").write_text("no tree")
  with pytest.raises(DataError, match=r"config.data.cluster.tree=.* is not a saved cluster tree"):
    cluster_index(_config(data_dir, cluster={"tree": str(tmp_path / "bad.npz")}), BYTE)


def test_a_word_the_corpus_never_had_weighs_nothing():
  embed = Embedder.fit(["red apple", "green apple", "red pear"], dim=32)
  np.testing.assert_array_equal(embed(["red zzz qqq"]), embed(["red"]))
  assert (embed(["zzz"]) == 0).all()


@pytest.mark.parametrize("field, value", [("k", -1), ("k", 1), ("levels", 0), ("seed", -1), ("words", -1)])
def test_invalid_cluster_fields_name_the_field(data_dir, field, value):
  with pytest.raises(DataError, match=f"config.data.cluster.{field}:"):
    make_train_iterator(_config(data_dir, cluster={field: value}))


def test_a_large_corpus_is_fitted_on_a_seeded_sample_of_its_documents():
  """Up to FIT_DOCUMENTS every document in order; past it that many distinct ones, sorted, the same for a seed and
  not for another."""
  cap = cluster_paths.FIT_DOCUMENTS
  np.testing.assert_array_equal(cluster_paths.fit_documents(1000, 0), np.arange(1000))
  np.testing.assert_array_equal(cluster_paths.fit_documents(cap, 0), np.arange(cap))
  a, b, c = (cluster_paths.fit_documents(3 * cap, seed) for seed in (0, 0, 1))
  assert len(a) == len(np.unique(a)) == cap and np.all(np.diff(a) > 0) and 0 <= a[0] and a[-1] < 3 * cap
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_the_tree_of_a_corpus_past_the_cap_is_the_one_fitted_on_its_sample(data_dir, monkeypatch):
  """With the cap at 64 documents, the cached tree is the one fit_index gives on those 64 documents' texts, read
  independently of cluster_index."""
  monkeypatch.setattr(cluster_paths, "FIT_DOCUMENTS", 64)
  c = _config(data_dir, cluster={"k": 4, "levels": 2, "seed": 101})  # a tree no other test has cached
  records, to_example = open_source(c, "train", BYTE)
  assert len(records) > 64
  chosen = cluster_paths.fit_documents(len(records), c.cluster.seed)
  expected = cluster_paths.fit_index([BYTE.decode(to_example(records[int(i)])[0]) for i in chosen], 4, 2,
                                     c.cluster.seed)
  index = cluster_index(c, BYTE)
  assert index.embedder == expected.embedder
  for got, want in zip(index.tree.centroids, expected.tree.centroids):
    np.testing.assert_array_equal(got, want)


def test_a_process_waits_for_the_tree_another_is_building_and_reads_it(data_dir):
  """While another process holds the tree's lock, cluster_index waits; once the tree is there and the lock is
  released, it reads that tree rather than fitting one of its own."""
  c = _config(data_dir, cluster={"k": 4, "levels": 2, "seed": 102})  # a tree no other test has cached
  path = index_path(c, BYTE)
  theirs = cluster_paths.fit_index([f"entity {i} works as a baker in town {i % 7}" for i in range(50)], 4, 2, 0)
  got = {}
  with exclusive(f"{path}.lock"):
    waiting = threading.Thread(target=lambda: got.update(index=cluster_index(c, BYTE)))
    waiting.start()
    waiting.join(timeout=2.0)
    assert waiting.is_alive() and not os.path.exists(path)  # it waits, and has not fitted a tree
    theirs.save(path)
  waiting.join()
  assert got["index"].embedder == theirs.embedder


def test_a_tree_of_first_words_sends_a_document_and_a_question_on_its_subject_one_way(data_dir, tmp_path):
  """data.cluster.words=2 on a biography corpus: each entity's name. Every training document and the prompt of each of
  its probes reach one path (prompt and document share their first two words, and only those are read); the tree
  is cached under its own name, keeps its words through save and load, and a tree of other words is refused."""
  facts = biography_facts(num_entities=20, num_docs=200, num_val_docs=20).to_dict()
  c = _config(data_dir, cluster={"k": 4, "levels": 2, "seed": 103, "words": 2}, facts=facts)
  assert index_path(c, BYTE).endswith(f"-s103-w2-{index_path(c, BYTE).rsplit('-', 1)[1]}")
  index = cluster_index(c, BYTE)  # fitted on this biography corpus's names
  assert index.words == 2
  corpus = generate(MocFactsConfig.for_sizes(c.facts))
  docs = [d["text"] for d in corpus["train"]]
  doc_paths = {}
  for d, path in zip(corpus["train"], index(docs)):
    doc_paths.setdefault(d["entity"], set()).add(tuple(path))
  assert all(len(paths) == 1 for paths in doc_paths.values())
  assert len(set.union(*doc_paths.values())) >= 4  # the names are split over the tree, not all on one path
  prompt_paths = index([p["prompt"] for p in corpus["probes"]])
  assert all({tuple(path)} == doc_paths[p["entity"]] for p, path in zip(corpus["probes"], prompt_paths))
  # only the first two words are read: a name followed by other entities' names keeps the first name's path
  path_of = {e: next(iter(paths)) for e, paths in doc_paths.items()}
  pairs = [(a, b) for a in path_of for b in path_of if path_of[a] != path_of[b]]
  mixed = index([f"{a}: {b} {b} {b}" for a, b in pairs])
  assert [tuple(p) for p in mixed] == [path_of[a] for a, _ in pairs]
  # the same corpus read whole sends some prompt off its entity's path: the words are what joins them
  whole = _config(data_dir, cluster={"k": 4, "levels": 2, "seed": 103}, facts=facts)
  whole_index = cluster_index(whole, BYTE)
  assert whole_index.words == 0 and index_path(whole, BYTE) != index_path(c, BYTE)
  whole_docs = {d["entity"]: tuple(p) for d, p in zip(corpus["train"], whole_index(docs))}
  assert any(tuple(p) != whole_docs[q["entity"]]
             for q, p in zip(corpus["probes"], whole_index([q["prompt"] for q in corpus["probes"]])))
  index.save(tmp_path / "words.npz")
  assert ClusterIndex.load(tmp_path / "words.npz").words == 2
  np.testing.assert_array_equal(ClusterIndex.load(tmp_path / "words.npz")(docs), index(docs))
  with pytest.raises(DataError, match=r"is a tree of k=4, 2 levels, words=2, and the config asks k=4, 2, words=0"):
    cluster_index(_config(data_dir, cluster={"k": 4, "levels": 2, "tree": str(tmp_path / "words.npz")}, facts=facts),
                  BYTE)
