"""`python -m moc_jax.eval` on a `memory.routing=cluster` run trained with the generic-memory control: the report's
generic figures (every document and probe on the generic chapters) and the level-wise knock-out
(`--ablate_chapters=level:L`), checked against what each must depend on — the generic CE on the generic chapters
alone, the fetched CE not at all on them, a level's knock-out on exactly the chapters its nodes own."""
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax.data import load_probes
from moc_jax.data.cluster_paths import cluster_index
from moc_jax.data.facts import MocFactsConfig, generate
from moc_jax.data.tokenizers import get_tokenizer
from moc_jax.errors import ConfigError
from moc_jax.eval.ce import CEEvaluator, split_batches
from moc_jax.eval.probes import ProbeEvaluator, select_probes
from moc_jax.config import memory_layers
from moc_jax.eval import routing as ra
from moc_jax.eval.routing import parse_ablation, zero_chapters
from moc_jax.eval.run import EvalOptions, evaluate, markdown_table
from tests.eval.eval_utils import save_run
from tests.train import train_utils as tu

# k = 4, two levels: 1 shared, level 0 owns 4 x 2 (chapters 1-8), level 1 16 x 1 (9-24), the generic ones 25-27
CLUSTER = {"memory.routing": "cluster", "data.cluster.k": 4, "data.cluster.levels": 2, "data.cluster.generic": 0.2,
           "memory.cluster_chapters": (2, 1), "memory.num_chapters": 28, "memory.num_tokens": 448,
           "train.num_probes": 16}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A saved cluster run at step 2, its zero-initialised weights re-drawn so every chapter reaches the loss."""
  data_dir, workdir = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("run")
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir, **CLUSTER))
  layout, params = save_run(config, workdir)
  return config, str(workdir), layout, params


def _ce(config, layout, params, paths):
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    return CEEvaluator(layout.graphdef, layout.shardings["params"], sharding.data_sharding(config, mesh),
                       split_batches(config, "validation", paths=paths))(params)["ce"]


@pytest.mark.slow  # ~35 s on 2 cores: three evaluations and their probes, compiled
def test_generic_figures_read_the_generic_chapters_alone(run, tmp_path):
  config, workdir, layout, params = run
  report = evaluate(config, workdir, EvalOptions(ablate_chapters="level:1", analyze_routing=False,
                                                 out=str(tmp_path / "eval.json")))
  generic = report["generic_paths"]
  assert generic["ce"] == pytest.approx(_ce(config, layout, params, "generic"), rel=1e-6)
  assert generic["ce_delta"] == pytest.approx(generic["ce"] - report["ce"], abs=1e-7) and generic["ce_delta"] != 0
  assert 0 <= generic["fact_recall"]["probe_acc"] <= 1 and "recall_delta" in generic
  # zero the generic chapters: the generic CE moves, the fetched CE (every document on its path) does not
  mask = np.zeros((1, 28), bool)
  mask[0, 25:] = True
  no_generic = zero_chapters(params, mask)
  assert _ce(config, layout, no_generic, "generic") != pytest.approx(generic["ce"], rel=1e-4)
  assert _ce(config, layout, no_generic, "document") == pytest.approx(report["ce"], rel=1e-6)
  # the leaves' knock-out zeroes chapters 9-24 and nothing else
  assert report["ablation"]["chapters"] == {"0": list(range(9, 25))}
  assert report["ablation"]["ce_delta"] != 0
  table = markdown_table(report)
  assert "every document on the generic chapters" in table and "fact recall on the generic chapters" in table


def test_level_knock_outs_name_the_levels_chapters(run):
  config = run[0]
  assert parse_ablation("level:0", config) == ("ids", list(range(1, 9)))
  assert parse_ablation("level:0,1", config) == ("ids", list(range(1, 25)))
  for bad in ("level:2", "level:", "level:x"):
    with pytest.raises(ConfigError, match="--ablate_chapters=.*data.cluster.levels"):
      parse_ablation(bad, config)
  routed = moc_jax.load_config("configs/moc.py:tiny")
  with pytest.raises(ConfigError, match="levels are a cluster tree's"):
    parse_ablation("level:0", routed)


@pytest.fixture(scope="module")
def biography_run(tmp_path_factory):
  """A saved cluster run (no generic control) on a biography corpus, where every document about an entity holds
  the same words, so all of them take one path down the tree."""
  data_dir, workdir = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("run")
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(
      data_dir, **{**CLUSTER, "data.cluster.generic": 0.0, "memory.num_chapters": 25, "memory.num_tokens": 400,
                   "data.facts.style": "biography", "data.facts.zipf_a": 0.0, "data.facts.num_docs": 400}))
  layout, params = save_run(config, workdir)
  return config, str(workdir), layout, params


@pytest.mark.slow  # ~30 s on 2 cores: an evaluation and a second pass of its probes, compiled
def test_entity_paths_read_each_probe_by_the_path_of_its_entitys_documents(biography_run, tmp_path):
  """Agreement and recall against paths taken independently: each probe's prompt traversed alone, and its entity's
  path as the tree sends a training document about that entity (read from the corpus, not rebuilt from probes)."""
  config, workdir, layout, params = biography_run
  report = evaluate(config, workdir, EvalOptions(analyze_routing=False, num_probes=0, out=str(tmp_path / "eval.json")))
  entity = report["entity_paths"]
  tokenizer = get_tokenizer(config.data.tokenizer)
  index = cluster_index(config.data, tokenizer)
  document = {}
  for doc in generate(MocFactsConfig.for_sizes(config.data.facts))["train"]:
    document.setdefault(doc["entity"], doc["text"])
  every = load_probes(config.data)
  probes = select_probes(every, len(every), config.seed)  # num_probes=0: every probe of an entity seen
  prompt_paths = index([p["prompt"] for p in probes])
  entity_paths = index([document[p["entity"]] for p in probes])
  assert entity["agreement"] == pytest.approx((prompt_paths == entity_paths).mean(0).tolist(), abs=1e-12)
  assert entity["agreement"][-1] < 1  # some prompts leave their entity's path: the two recalls can differ
  evaluator = ProbeEvaluator(layout.graphdef, [{**p, "cluster_path": q} for p, q in zip(probes, entity_paths)],
                             tokenizer)
  correct, exact = evaluator.per_probe(params)
  assert entity["fact_recall"]["probe_acc"] == pytest.approx(float(np.mean(correct)), abs=1e-12)
  assert entity["recall_delta"] == pytest.approx(entity["fact_recall"]["probe_acc"]
                                                 - report["fact_recall"]["probe_acc"], abs=1e-12)
  # the path alone: each probe's answer guessed from the other entities whose documents take its entity's path
  path_of = {name: tuple(index([text])[0]) for name, text in document.items()}
  facts = {(p["entity"], p["attribute"]): p["answer"] for p in every}
  credit = 0.0
  for p in probes:
    others = [n for n in path_of if n != p["entity"] and path_of[n] == path_of[p["entity"]]]
    votes = [sum(facts[n, p["attribute"]] == c for n in others) for c in p["candidates"]]
    tied = [c for c, v in zip(p["candidates"], votes) if v == max(votes)]
    credit += (p["answer"] in tied) / len(tied)
  assert entity["path_alone"] == pytest.approx(credit / len(probes), abs=1e-12)
  assert "every probe on its entity's path" in markdown_table(report)


def test_the_summary_of_an_ffn_memory_counts_its_columns():
  """An ffn memory's rows are columns (eval.routing.Usage): the summary's routing table reads their counts. By hand:
  columns 2 and 5 of the 24 routable read 6 and 2 times: 2 selected (8%), entropy of (3/4, 1/4), e^0.562 = 1.75."""
  config = moc_jax.load_config("configs/moc.py:tiny", {
      "memory.kind": "ffn", "memory.routing": "cluster", "data.cluster.k": 4, "data.cluster.levels": 2,
      "memory.cluster_chapters": (2, 1), "memory.num_chapters": 25})
  usage = ra.Usage(config)
  usage.counts[:, usage.num_shared + 2], usage.counts[:, usage.num_shared + 5] = 6, 2
  report = {"workdir": "w", "step": 1, "config": "c", "devices": 1, "split": "validation", "ce": 1.0, "ppl": 2.7,
            "tokens": 10, "files": {}, "routing": {"kind": "ffn", "routing": "cluster", "load_balance": None,
                                                   "num_shared": usage.num_shared, "layers": usage.stats()}}
  table = markdown_table(report)
  assert "| memory layer | columns ever selected |" in table
  for layer in memory_layers(config):
    assert f"| {layer} | 2 (8%) | " in table and " | 1.8 | " in table
