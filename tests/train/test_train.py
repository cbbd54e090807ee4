"""The main job end to end: training, evaluating the saved run, init_from, the process-count check (faults and
their recovery: tests/train/test_faults.py)."""
import json
import math
import os

import jax
import numpy as np
import pytest

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.eval import evaluate
from moc_jax import main as main_lib
from tests.train import train_utils as tu



@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


# vanilla (slow): the same loop and artifacts without memory; tests/train/test_faults.py trains vanilla tiny by default
@pytest.mark.parametrize("spec", ["configs/moc.py:tiny", pytest.param("configs/vanilla.py:tiny", marks=pytest.mark.slow)])
def test_two_steps_write_every_artifact(spec, data_dir, tmp_path):
  config = moc_jax.load_config(spec, tu.overrides(data_dir))
  last = main_lib.train(config, str(tmp_path))
  rows = tu.read_metrics(tmp_path)
  train = [r for r in rows if "split" not in r]
  evals = [r for r in rows if r.get("split") == "validation"]
  assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
  for key in ("loss", "ce", "aux", "lr", "grad_norm", "tokens_per_s", "data_wait_frac", "mfu"):
    assert math.isfinite(train[-1][key]), key
  assert train[0]["lr"] == 0.0  # λ(0) = 0 on the first update
  assert (train[-1]["aux"] > 0) == spec.startswith("configs/moc.py")
  assert 0.0 <= evals[0]["probe_acc"] <= 1.0 and evals[0]["ce"] > 0
  assert last["step"] == 2
  for name in ("config.json", "loss.png", "checkpoints", "tensorboard"):
    assert os.path.exists(tmp_path / name), name
  assert json.load(open(tmp_path / "config.json"))["model"]["d_model"] == config.model.d_model
  from moc_jax.eval import EvalOptions  # --mode=eval on the saved checkpoint (routing analysis: tests/eval/test_run.py)
  again = evaluate(config, str(tmp_path), EvalOptions(analyze_routing=False))
  assert again["step"] == 2 and again["ce"] == pytest.approx(evals[-1]["ce"], rel=1e-6)


@pytest.mark.slow
def test_init_from_loads_weights_with_fresh_optimizer_and_step(data_dir, tmp_path):
  """The first update of the new run has lr 0 (λ(0) = 0), so its step-1 params equal the source's weights."""
  src = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir))
  main_lib.train(src, str(tmp_path / "src"))
  dst = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(
      data_dir, **{"train.steps": 1, "train.checkpoint_every": 1, "train.init_from": str(tmp_path / "src")}))
  main_lib.train(dst, str(tmp_path / "dst"))
  abstract = state_lib.build_state(dst, sharding.make_mesh(dst)).abstract
  from moc_jax.checkpoint import restore_params
  a, step_a = restore_params(str(tmp_path / "src"), abstract["params"])
  b, step_b = restore_params(str(tmp_path / "dst"), abstract["params"])
  assert (step_a, step_b) == (2, 1)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rows = [r for r in tu.read_metrics(tmp_path / "dst") if "split" not in r]
  assert [r["step"] for r in rows] == [1] and rows[0]["lr"] == 0.0


def test_resume_with_another_process_count_is_refused_with_the_fix(tmp_path):
  from moc_jax import checkpoint as ckpt_lib
  d = tmp_path / "data_iter"
  d.mkdir()
  for i in range(2):
    (d / f"process_{i}-of-2.json").write_text("{}")
  with pytest.raises(ckpt_lib.CheckpointError, match="saved by 2 processes.*init_from"):
    ckpt_lib._check_process_count(str(d))
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "process_0-of-1.json").write_text("{}")
  ckpt_lib._check_process_count(str(tmp_path / "one"))
