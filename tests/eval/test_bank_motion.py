"""bank_motion against a hand computation: a saved run whose bank is its initial draw at step 1 and a known
change of it at step 2."""
import jax
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.eval import bank_motion
from moc_jax.checkpoint import Checkpointer
from tests.train import train_utils as tu


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Steps 1 and 2 of a tiny MoC run: the init, then every bank token doubled except chapter 3's, which is
  negated. Returns (workdir, the initial bank as float64)."""
  data_dir, workdir = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("run")
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir))
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    checkpointer = Checkpointer(str(workdir / "checkpoints"), padding=layout.padding)
    checkpointer.save(1, state)
    (path, bank), = [(p, v) for p, v in nnx.to_flat_state(state["params"]) if "bank" in p]
    init = np.asarray(bank[...], np.float64)
    moved = np.where(np.arange(init.shape[1])[None, :, None, None] == 3, -init, 2 * init)
    params = nnx.from_flat_state([(p, v.replace(jax.device_put(moved.astype(np.float32), v.sharding))
                                   if p == path else v) for p, v in nnx.to_flat_state(state["params"])])
    checkpointer.save(2, {**state, "params": params})
    checkpointer.close()
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  return str(workdir), init


def test_motion_by_hand(run):
  workdir, init = run
  chapters = init.shape[1]
  moved_rms = np.sqrt(np.mean(np.square(init * np.where(np.arange(chapters) == 3, 1, 2)[None, :, None, None])))
  first, second = bank_motion.motion(workdir)
  assert (first["step"], second["step"]) == (1, 2)
  assert first["rms"] == pytest.approx(np.sqrt(np.mean(init ** 2)), rel=1e-6)
  assert first["cos_init"] == pytest.approx(1.0, abs=1e-6) and first["cos_previous"] is None
  # Every token keeps its direction but chapter 3's, which reverses: cos = (C - 2) / C over equal token counts.
  assert second["rms"] == pytest.approx(moved_rms, rel=1e-6)
  assert second["cos_init"] == pytest.approx((chapters - 2) / chapters, abs=1e-6)
  assert second["cos_previous"] == pytest.approx((chapters - 2) / chapters, abs=1e-6)


def test_a_missing_workdir_is_one_line_and_exit_2(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    bank_motion.main([str(tmp_path / "no_such_run")])
  assert e.value.code == 2 and capsys.readouterr().err.startswith("error: ")
