"""Router health in the training log: window loads summed across steps, the per-layer columns, and one
collapse warning per layer (hand-made loads); the eval-side bias spread."""
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.eval.routing import Usage, balance_bias_spread
from moc_jax.router_health import collapse, load_stats
from moc_jax.train.metrics import RouterWindow


def test_load_stats_and_collapse_by_hand():
  assert load_stats([100, 3, 1, 0, 0], 1) == {"used_frac": 0.5, "max_load": 3.0}
  assert collapse({"used_frac": 0.2, "shared_mass": 0.1}) == "only 20% of routable chapters read"
  assert "shared chapters" in collapse({"used_frac": 1.0, "shared_mass": 0.95})
  assert collapse({"used_frac": 0.3, "shared_mass": 0.5}) is None


def test_router_window_sums_the_window_and_warns_once_per_layer(caplog):
  config = moc_jax.load_config("configs/moc.py:tiny")  # memory layers 1 and 3, 65 chapters, 1 shared
  window = RouterWindow(config)
  collapsed = np.zeros((2, 65), np.float32)
  collapsed[:, 1:9] = 4.0  # 8 of 64 routable chapters
  spread = np.ones((2, 65), np.float32)
  step = {"router_shared_mass": np.array([0.1, 0.2]), "router_routed_entropy": np.array([2.0, 3.0])}
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    for metrics, step_no in (((collapsed, spread), 25), ((collapsed, collapsed), 50)):
      for load in metrics:
        window.add({"router_load": jnp.asarray(load)})
      row = window.row(step_no, step)
  assert row["router_used_frac_L1"] == 8 / 64 and row["router_max_load_L1"] == 8.0  # 2 steps of 4 on 8 chapters
  assert row["router_shared_mass_L3"] == pytest.approx(0.2) and row["router_routed_entropy_L1"] == 2.0
  warnings = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
  assert len(warnings) == 2 and "step 50" in warnings[0] and "layer 1" in warnings[0]  # the first window was fine
  assert window.row(75, step) == {}  # nothing added since the last row


def test_eval_usage_averages_router_statistics_and_reads_the_bias_spread():
  config = moc_jax.load_config("configs/moc.py:tiny", {"memory.load_balance": "aux_free", "memory.routing": "sequence"})
  usage = Usage(config)
  chapters = np.tile(np.arange(9), (2, 3, 1))  # [n_mem, B, 1 + 8] (sequence routing)
  for mass in (0.2, 0.4):
    usage.add({"chapters": chapters, "shared_mass": np.array([mass, 1.0]), "routed_entropy": np.array([1.0, 2.0])},
              np.ones((3, 4)))
  a, b = usage.stats()
  assert a["shared_mass"] == pytest.approx(0.3) and b["routed_entropy"] == 2.0 and a["chapters_selected"] == 8
  model = moc_jax.build_model(config)
  params = nnx.state(model, nnx.Param)
  assert balance_bias_spread(params, 1) == [0.0, 0.0]
  bias = model.layers.blocks[1].memory.router.balance_bias  # scanned: [groups, C]
  bias.set_value(bias[...].at[1, 5].set(0.3).at[1, 0].set(9.0))  # the shared chapter's bias is not counted
  assert balance_bias_spread(nnx.state(model, nnx.Param), 1) == pytest.approx([0.0, 0.3])
  assert balance_bias_spread(nnx.state(moc_jax.build_model(moc_jax.load_config("configs/moc.py:tiny")), nnx.Param),
                             1) is None
