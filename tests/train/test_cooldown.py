"""train.cooldowns (moc_jax/train/cooldown.py): a cool-down's evaluation is the final evaluation of the shorter run
trained on its own, the run goes on as without it, and a run stopped during one resumes and trains it once."""
import logging

import pytest

import moc_jax
from moc_jax import main as main_lib
from moc_jax.checkpoint import saved_steps
from moc_jax.errors import ConfigError
from moc_jax.train import cooldown, loop
from tests.train import train_utils as tu

SPEC = "configs/vanilla.py:tiny"
# 10 updates, warm-up 1, the decay from update 8 (ratio 0.8); the cool-down of half the steps is the run of 5 updates,
# whose decay starts at update 4: the branch trains updates 5 from the state after 4. Evaluations only at the end.
RUN = {"train.steps": 10, "train.warmup_steps": 1, "train.eval_every": 100, "train.checkpoint_every": 3,
       "train.log_every": 1}
HALF = 0.5


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


def _train(data_dir, workdir, **extra):
  main_lib.train(moc_jax.load_config(SPEC, tu.overrides(data_dir, **{**RUN, **extra})), str(workdir))
  return tu.read_metrics(workdir)


def _rows(rows, split):
  return [r for r in rows if r.get("split") == split]


def _scores(row):
  return {k: v for k, v in row.items() if k not in ("step", "split", "cooldown_end")}


@pytest.fixture(scope="module")
def cooled(data_dir, tmp_path_factory):
  """The run with its cool-down at half the steps, and what it logged."""
  workdir, lines = tmp_path_factory.mktemp("cooled"), []
  handler = logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger("moc_jax")
  logger.addHandler(handler)
  try:
    return workdir, _train(data_dir, workdir, **{"train.cooldowns": (HALF,)}), lines
  finally:
    logger.removeHandler(handler)


def test_a_cooldown_scores_what_the_shorter_run_trained_on_its_own_ends_with(data_dir, cooled, tmp_path):
  (row,) = _rows(cooled[1], cooldown.SPLIT)
  assert (row["step"], row["cooldown_end"]) == (4, 5)
  shorter = _train(data_dir, tmp_path, **{"train.steps": 5})
  (final,) = [r for r in _rows(shorter, "validation") if r["step"] == 5]
  assert _scores(row) == _scores(final)
  # its progress line (every train.log_every updates of the branch) shows the shorter run's own train loss
  (progress,) = [line for line in cooled[2] if line.startswith("moc_jax: cool-down step")]
  (last,) = [r for r in shorter if "split" not in r and r["step"] == 5]
  assert progress.startswith(f"moc_jax: cool-down step 5/5 loss={last['loss']:.4f} ce={last['ce']:.4f} eta=")


def test_the_run_goes_on_as_without_its_cooldown(data_dir, cooled, tmp_path):
  plain = _train(data_dir, tmp_path)
  assert tu.train_losses(cooled[0]) == tu.train_losses(tmp_path)
  assert _rows(cooled[1], "validation") == _rows(plain, "validation")


def test_a_run_stopped_in_its_cooldown_resumes_from_where_it_started_and_trains_it_once(data_dir, cooled, tmp_path,
                                                                                        monkeypatch):
  """A signal during the branch: the run stops with its checkpoint at the branch's start (update 4, not on the
  checkpoint cadence); the same command resumes there, trains the branch and ends as the run never stopped did."""
  off = cooldown.Branches.off
  monkeypatch.setattr(cooldown.Branches, "off", lambda self, *a: off(self, *a[:-1], lambda: True))
  stopped = _train(data_dir, tmp_path, **{"train.cooldowns": (HALF,)})
  assert not _rows(stopped, cooldown.SPLIT) and max(r["step"] for r in stopped) == 4
  assert saved_steps(tmp_path / "checkpoints") == [3, 4]
  monkeypatch.setattr(cooldown.Branches, "off", off)
  resumed = _train(data_dir, tmp_path, **{"train.cooldowns": (HALF,)})
  assert tu.train_losses(tmp_path) == tu.train_losses(cooled[0])
  assert _rows(resumed, cooldown.SPLIT) == _rows(cooled[1], cooldown.SPLIT)
  assert _rows(resumed, "validation") == _rows(cooled[1], "validation")


def test_a_cooldown_behind_the_step_a_run_resumes_at_is_named_and_not_trained(data_dir, tmp_path, caplog):
  _train(data_dir, tmp_path, **{"train.steps": 6})
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    rows = _train(data_dir, tmp_path, **{"train.cooldowns": (HALF,)})
  assert "past the start of the cool-downs from steps [4]" in caplog.text
  assert not _rows(rows, cooldown.SPLIT)


def test_the_logged_throughput_counts_every_training_step_of_its_window_and_no_branch_step(data_dir, tmp_path,
                                                                                            monkeypatch):
  """Logged every 5 updates, checkpointed and evaluated only at the end: the row at update 5 counts update 5 only (the
  window starts again after the branch off update 4, whose time is no training time of the run), the row at 10 counts
  updates 6 to 10."""
  counted = []
  row = loop.Throughput.row
  monkeypatch.setattr(loop.Throughput, "row", lambda self, steps, seconds: counted.append(steps) or row(self, steps,
                                                                                                         seconds))
  _train(data_dir, tmp_path, **{"train.cooldowns": (HALF,), "train.log_every": 5, "train.checkpoint_every": 100})
  assert counted == [1, 5]


@pytest.mark.parametrize("cooldowns, says", [
    ((1.0,), "1.0 is not a fraction of train.steps in (0, 1)"),
    ((0.5, 0.52), "two of (0.5, 0.52) start their decay at step 4"),
    ((0.1,), "0.1 of train.steps is a run of 1 steps whose decay would start at step 1: it has no decay"),
])
def test_a_cooldown_that_is_no_shorter_run_with_a_decay_is_refused_by_name(cooldowns, says, data_dir):
  with pytest.raises(ConfigError, match="config.train.cooldowns") as e:
    moc_jax.load_config(SPEC, tu.overrides(data_dir, **{**RUN, "train.cooldowns": cooldowns}))
  assert says in str(e.value)


def test_cooldowns_need_a_schedule_that_decays(data_dir):
  with pytest.raises(ConfigError, match="train.schedule='constant', which never decays"):
    moc_jax.load_config(SPEC, tu.overrides(data_dir, **{**RUN, "train.cooldowns": (HALF,),
                                                        "train.schedule": "constant"}))
