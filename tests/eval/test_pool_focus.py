"""pool_focus: the answer decision's share of pooling weight on the entity, by hand on made-up weights, and on a
saved run whose query is its initial zero (equal weights: the share is the entity's share of the prompt's tokens)."""
import json

import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.checkpoint import Checkpointer
from moc_jax.eval import pool_focus
from tests.train import train_utils as tu

WEIGHTS = np.array([[[1, 2, 3, 4, 5, 9], [4, 1, 1, 2, 9, 9]]], np.float32)  # 1 layer, 2 prompts (9: padding)
LENGTHS, SPANS = [5, 4], [(1, 3), (0, 2)]


def test_focus_by_hand_prefix():
  (layer,) = pool_focus.focus(WEIGHTS, LENGTHS, SPANS, "prefix", 64)
  assert layer["entity_share"] == pytest.approx(((2 + 3) / 15 + (4 + 1) / 8) / 2)
  assert layer["uniform_share"] == pytest.approx((2 / 5 + 2 / 4) / 2)
  assert layer["top_positions"] == [4, 0]


def test_focus_by_hand_chunk():
  """Chunks of 2: the answer decision of a 5-token prompt pools positions 0-3, of a 4-token one positions 0-1."""
  (layer,) = pool_focus.focus(WEIGHTS, LENGTHS, SPANS, "chunk", 2)
  assert layer["entity_share"] == pytest.approx(((2 + 3) / 10 + 1.0) / 2)
  assert layer["uniform_share"] == pytest.approx((2 / 4 + 1.0) / 2)
  assert layer["top_positions"] == [3, 0]
  # chunks of 4: the 4-token prompt's decision pools nothing and is left out, keeping its place in the list
  (layer,) = pool_focus.focus(WEIGHTS, LENGTHS, SPANS, "chunk", 4)
  assert layer["entity_share"] == pytest.approx((2 + 3) / 10) and layer["uniform_share"] == pytest.approx(2 / 4)
  assert layer["top_positions"] == [3, None]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Two saved initial states of the tiny model on moc_facts: attention-pooled (query zero) and mean-pooled."""
  data_dir = tmp_path_factory.mktemp("data")
  out = {}
  for pool in ("attention", "mean"):
    workdir = tmp_path_factory.mktemp(pool)
    config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(
        data_dir, **{"memory.routing": "prefix", "memory.routing_pool": pool}))
    mesh = sharding.make_mesh(config)
    with sharding.activate(mesh, sharding.rules_of(config)):
      layout = state_lib.build_state(config, mesh)
      checkpointer = Checkpointer(str(workdir / "checkpoints"), padding=layout.padding)
      checkpointer.save(1, layout.init())
      checkpointer.close()
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    out[pool] = (str(workdir), config)
  moc_jax.data.load_probes(config.data)  # prepared here, as training would have, so the command prints JSON only
  return out


def test_a_zero_query_weighs_the_entity_by_its_length(runs, capsys):
  workdir, config = runs["attention"]
  assert pool_focus.main([workdir, "--probes=6", "--json"]) in (None, 0)
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  probes = pool_focus.select_probes(moc_jax.data.load_probes(config.data), 6, config.seed)
  by_length = np.mean([len(p["entity"]) / len(p["prompt"]) for p in probes])  # one token per character
  assert [r["layer"] for r in rows] == [1, 3] and all(r["probes"] == 6 for r in rows)
  for r in rows:
    assert r["entity_share"] == pytest.approx(by_length, rel=1e-6) == r["uniform_share"]


def test_a_mean_pooled_run_is_refused(runs, capsys):
  with pytest.raises(SystemExit) as e:
    pool_focus.main([runs["mean"][0]])
  assert e.value.code == 2 and "memory.routing_pool is not attention" in capsys.readouterr().err
