"""`python -m moc_jax.eval` on a `memory.routing=cluster` run trained with the generic-memory control: the report's
generic figures (every document and probe on the generic chapters) and the level-wise knock-out
(`--ablate_chapters=level:L`), checked against what each must depend on — the generic CE on the generic chapters
alone, the fetched CE not at all on them, a level's knock-out on exactly the chapters its nodes own."""
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax.errors import ConfigError
from moc_jax.eval.ce import CEEvaluator, split_batches
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
