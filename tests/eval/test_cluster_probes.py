"""Fact-recall probes under `memory.routing=cluster` fetch by their prompt's path alone: every row of a probe (each
candidate continuation) reads by the path of the prompt's text, never of the prompt with its answer."""
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.data import load_probes
from moc_jax.data.cluster_paths import cluster_index
from moc_jax.data.tokenizers import get_tokenizer
from moc_jax.eval.probes import ProbeEvaluator, with_prompt_paths

BYTE = get_tokenizer("byte")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  return moc_jax.load_config("configs/moc.py:tiny", {
      "model.compute_dtype": "float32", "memory.wo_init_zero": False, "memory.routing": "cluster",
      "data.cluster.k": 4, "data.cluster.levels": 2, "memory.cluster_chapters": (4, 3),
      "data.data_dir": str(tmp_path_factory.mktemp("data")), "data.facts.num_entities": 40,
      "data.facts.num_docs": 300, "data.facts.num_val_docs": 30})


def test_probes_read_by_their_prompts_path(config):
  probes = with_prompt_paths(config, load_probes(config.data)[:24], BYTE)
  index = cluster_index(config.data, BYTE)
  prompts = index([p["prompt"] for p in probes])
  np.testing.assert_array_equal([p["cluster_path"] for p in probes], prompts)
  evaluator = ProbeEvaluator(nnx.split(moc_jax.build_model(config))[0], probes, BYTE)
  rows = evaluator.rows.paths.reshape(len(probes), evaluator.num_candidates, -1, 2)
  assert (rows == prompts[:, None, None]).all() and (evaluator.gen_paths == prompts[:, None]).all()


def test_the_score_follows_the_path(config):
  model = moc_jax.build_model(config, seed=1)
  probes = with_prompt_paths(config, load_probes(config.data)[:4], BYTE)
  evaluator = ProbeEvaluator(nnx.split(model)[0], probes, BYTE)
  params = nnx.state(model)
  own = evaluator.scorer(params, evaluator.rows)[0]
  moved = evaluator.rows._replace(paths=(evaluator.rows.paths + 1) % 4)
  assert not np.allclose(own, evaluator.scorer(params, moved)[0])
