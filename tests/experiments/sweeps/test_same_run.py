"""same_run: which two configs train the same run, so a harness may copy one's finished workdir for the
other. Checked both ways: on resolved configs (what must and must not count), and by training both sides of
each rule and comparing every logged loss and the final evaluation."""
import pytest

import moc_jax
from experiments.sweeps.plan import resolve, same_run
from moc_jax import main as main_lib
from tests.train import train_utils as tu

SPEC = "configs/moc.py:tiny"
NO_MEMORY = {"memory.enabled": False, "memory.placement": "none", "model.mlp_dim": 288}
ARM = {"memory.load_balance": "mocpt", "memory.routing": "sequence"}  # not tiny's own routing


def config_of(**overrides):
  return resolve(SPEC, {"train.steps": 450, **{k.replace("__", "."): v for k, v in overrides.items()}})


@pytest.mark.parametrize("a, b, same", [
    ({"train__eval_every": 450}, {"train__eval_every": 1800}, True),  # both evaluate at 0 and at the end only
    ({"train__eval_every": 150}, {"train__eval_every": 1800}, False),  # one evaluates midway
    ({}, {"memory__load_balance": "mocpt"}, False),
    ({}, {"seed": 1}, False),
    ({"train__steps": 450}, {"train__steps": 900}, False),
])
def test_what_makes_two_moc_configs_the_same_run(a, b, same):
  assert same_run(config_of(**a), config_of(**b)) is same


def test_a_model_without_memory_ignores_the_memory_fields_it_does_not_read():
  dense = {k.replace(".", "__"): v for k, v in NO_MEMORY.items()}
  arm = {k.replace(".", "__"): v for k, v in ARM.items()}
  assert same_run(config_of(**dense), config_of(**dense, **arm))
  assert not same_run(config_of(**dense), config_of(**{**dense, "model__mlp_dim": 256}))
  assert not same_run(config_of(**arm), config_of(**dense, **arm))


@pytest.mark.parametrize("a, b", [
    # MoC, evaluated at the end only either way
    pytest.param(ARM, {**ARM, "train.eval_every": 4}, marks=pytest.mark.slow),
    # no memory: the arm's fields are not read either (slow: the rule itself is the tests above)
    pytest.param(NO_MEMORY, {**NO_MEMORY, **ARM, "train.eval_every": 4}, marks=pytest.mark.slow),
], ids=["moc-eval_every", "vanilla-memory-fields-eval_every"])
def test_configs_that_are_the_same_run_train_the_same_losses(a, b, tmp_path):
  base = tu.overrides(tmp_path / "data")  # 2 steps, evaluated at step 0 and at the end
  configs = [moc_jax.load_config(SPEC, {**base, **side}) for side in (a, b)]
  assert same_run(*configs)
  runs = []
  for i, config in enumerate(configs):
    main_lib.train(config, str(tmp_path / f"run{i}"))
    rows = tu.read_metrics(tmp_path / f"run{i}")
    runs.append((tu.train_losses(tmp_path / f"run{i}"), [r["ce"] for r in rows if r.get("split") == "validation"]))
  assert runs[0] == runs[1] and len(runs[0][0]) == 2 and len(runs[0][1]) == 2
