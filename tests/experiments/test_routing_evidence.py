"""The routing evidence harness's verdicts (experiments/routing_evidence.py): the chosen arm, gaps in standard
errors and each goal met or not, on hand-made seed groups. The harness end to end runs in CI
(`python -m experiments.routing_evidence --quick`, .ci/run)."""
import json
import math

import pytest

from experiments import routing_evidence as evidence
from experiments.evaluation import EVAL_TIME
from experiments.sweeps.plan import Point, resolve
from moc_jax.errors import UsageError


def group(point, kind="moc", **metrics):
  overrides = metrics.pop("overrides", {})
  return {"point": point, "kind": kind, "n": 3, "overrides": overrides, **metrics}


ARMS = [group("dense-mlp288", "dense", fact_recall=0.9, val_ce=0.1),
        group("mocpt-sequence", fact_recall=0.40, val_ce=0.30,
              overrides={"memory.load_balance": "mocpt", "memory.routing": "sequence"}),
        group("routed-prefix", fact_recall=0.45, val_ce=0.31,
              overrides={"memory.load_balance": "routed", "memory.routing": "prefix", "seed": 0}),
        group("aux_free-segment", fact_recall=0.45, val_ce=0.29,
              overrides={"memory.load_balance": "aux_free", "memory.load_balance_coef": 0.0,
                         "memory.routing": "segment"})]


def test_the_chosen_arm_is_causal_with_the_best_moc_recall_then_the_lower_ce():
  causal = [group("aux_free-prefix", fact_recall=0.45, val_ce=0.30,
                  overrides={"memory.load_balance": "aux_free", "memory.load_balance_coef": 0.0,
                             "memory.routing": "prefix"})]
  # The vanilla's higher recall is not an arm; neither non-causal arm is chosen, however good.
  assert evidence.choose_arm(ARMS)["point"] == "routed-prefix"
  chosen = evidence.choose_arm(ARMS + causal)
  assert chosen["point"] == "aux_free-prefix"  # recall tied with routed-prefix: the lower CE
  assert evidence.arm_overrides(chosen) == {"memory.load_balance": "aux_free", "memory.load_balance_coef": 0.0,
                                            "memory.routing": "prefix"}
  assert evidence.arm_overrides(evidence.choose_arm(ARMS, "aux_free-segment")) == {
      "memory.load_balance": "aux_free", "memory.load_balance_coef": 0.0, "memory.routing": "segment"}
  with pytest.raises(UsageError, match="--moc=dense-mlp288: no such MoC arm"):
    evidence.choose_arm(ARMS, "dense-mlp288")
  with pytest.raises(UsageError, match="no causal MoC arm"):
    evidence.choose_arm(ARMS[:2])


def test_gap_in_combined_standard_errors():
  assert evidence.z_gap(0.5, 0.03, 0.4, 0.04) == pytest.approx(2.0)
  assert evidence.z_gap(0.4, 0.03, 0.5, 0.04) == pytest.approx(-2.0)
  assert math.isnan(evidence.z_gap(0.5, 0.0, 0.4, 0.0))


def _budget(moc_recall, moc_se, dense_recall, dense_se, steps):
  return [group(f"steps{steps}", fact_recall=moc_recall, fact_recall_se=moc_se, overrides={"train.steps": steps}),
          group(f"dense-mlp288-steps{steps}", "dense", fact_recall=dense_recall, fact_recall_se=dense_se,
                overrides={"train.steps": steps})]


def _bank(ce, recall):
  return [group(f"bank{n}", val_ce=c, fact_recall=r, overrides={"memory.num_tokens": n})
          for n, c, r in zip((1040, 144, 528, 272), ce, recall)]  # out of order: goals sorts by size


def test_goals_met():
  chosen = group("routed-prefix", eval_used_frac=0.95, eval_max_load=2.5, paraphrase_jaccard=0.4,
                 other_entity_jaccard=0.3)
  budget = _budget(0.60, 0.01, 0.55, 0.015, 900) + _budget(0.5, 0.02, 0.5, 0.02, 450)
  result = evidence.goals(chosen, _bank((0.25, 0.31, 0.27, 0.29), (0.5, 0.2, 0.4, 0.3)), budget)
  assert [g["met"] for g in result] == [True, True, True, True]
  assert "met at 1 of 2 budgets; 450 steps: 0.500 vs 0.500 (+0.0 SE); 900 steps: 0.600 vs 0.550 (+2.8 SE)" in (
      result[2]["detail"])
  assert result[3]["detail"].startswith("144 tokens: CE 0.3100, recall 0.200; 272 tokens")


def test_goals_missed_each_by_its_own_measure():
  chosen = group("routed-segment", eval_used_frac=0.94, eval_max_load=4.6, paraphrase_jaccard=0.3,
                 other_entity_jaccard=0.3)
  # recall 1.9 SE ahead; the bank's CE falls throughout but its recall dips once.
  bank = _bank((0.25, 0.31, 0.27, 0.29), (0.5, 0.2, 0.3, 0.4))
  result = evidence.goals(chosen, bank, _budget(0.619, 0.02, 0.57, 0.0168, 900))
  assert [g["met"] for g in result] == [False, False, False, False]
  assert "0.940 read, max / mean load 4.60" in result[0]["detail"]
  assert not evidence.goals(chosen, bank[:3], [])[3]["met"]  # three sizes are not enough


def test_recall_held_by_the_bank_per_budget():
  """MoC's recall against the same runs' with the routable bank zeroed, by budget; dense points have none."""
  budget = _budget(0.60, 0.01, 0.55, 0.015, 900) + _budget(0.5, 0.02, 0.5, 0.02, 450)
  budget[0].update(recall_without_bank=0.45, recall_without_bank_se=0.02)
  budget[2].update(recall_without_bank=0.5, recall_without_bank_se=math.nan)
  lines = evidence.held_by_bank(budget)
  assert lines[4:6] == ["| 450 | 0.500 ± 0.020 | 0.500 | +0.000 |",
                        "| 900 | 0.600 ± 0.010 | 0.450 ± 0.020 | +0.150 |"]
  assert evidence.held_by_bank(budget[1::2]) == []  # no MoC point was ablated


def test_evidence_lists_the_budget_stage_recall_by_entity_documents():
  """evidence.md shows MoC's and the vanilla's recall per bucket of the entity's training documents, budget stage."""
  budget = _budget(0.60, 0.01, 0.55, 0.015, 900)
  budget[0]["recall_by_docs"] = {"10-29": (0.40, 0.02, 3), "100-299": (0.95, 0.01, 3)}
  budget[1]["recall_by_docs"] = {"10-29": (0.30, 0.01, 3), "100-299": (0.97, math.nan, 1)}
  chosen = group("routed-prefix", eval_used_frac=0.95, eval_max_load=2.5, paraphrase_jaccard=0.4,
                 other_entity_jaccard=0.3)
  stages = {"budget": {"groups": budget, "wall_s": 1.0, "eval_s": 1.0}}
  text = evidence.markdown("configs/moc.py:tiny", "default", stages, chosen, [], "a machine")
  assert ("| point | seeds | 10-29 docs | 100-299 docs |\n|---|---:|---:|---:|\n| steps900 | 3 | 0.400 ± 0.020 | "
          "0.950 ± 0.010 |\n| dense-mlp288-steps900 | 3 | 0.300 ± 0.010 | 0.970 (1 of 3 seeds) |") in text


def test_stages_are_named_and_a_stage_without_arms_needs_the_arm_named(tmp_path):
  """--stages takes arms, bank and budget; run without stage `arms` in --out, --moc must name a MoC arm of the
  routing sweep, and the arm's overrides come from the sweep's plan. Each refusal comes before any training."""
  spec = "configs/moc.py:tiny"
  with pytest.raises(UsageError, match="--stages=bank,bnk: name one or more of arms, bank, budget"):
    evidence.run(str(tmp_path), spec, True, 1, stages=["bank", "bnk"])
  with pytest.raises(UsageError, match="name it with --moc"):
    evidence.run(str(tmp_path), spec, True, 1, stages=["budget"])
  with pytest.raises(UsageError, match="--moc=dense-mlp288: no such MoC arm; the arms are .*'routed-prefix'"):
    evidence.run(str(tmp_path), spec, True, 1, moc="dense-mlp288", stages=["budget"])
  assert list(tmp_path.iterdir()) == []
  arm = evidence.named_arm(spec, "aux_free-segment")
  assert evidence.arm_overrides(arm) == {"memory.load_balance": "aux_free", "memory.load_balance_coef": 0.0,
                                         "memory.routing": "segment"}


def test_goals_of_stages_not_in_the_directory_are_not_judged():
  budget = _budget(0.60, 0.01, 0.55, 0.015, 900)
  result = evidence.goals(None, None, budget)
  assert [g["goal"].split(":")[0] for g in result] == [
      "MoC's fact recall beats the iso-FLOP vanilla's by ≥ 2 standard errors at equal training FLOPs"]
  stages = {"budget": {"groups": budget, "wall_s": 10.0, "eval_s": 5.0, "run": False, "done": 2, "points": 6}}
  text = evidence.markdown("configs/moc.py:tiny", "default", stages, group("routed-prefix", overrides={
      "memory.load_balance": "routed", "memory.routing": "prefix"}), result, "a machine")
  assert "Not run by this invocation: 2 of its 6 runs have finished in budget/." in text
  assert "MoC arm: **routed-prefix** (--moc; {'memory.load_balance': 'routed', 'memory.routing': 'prefix'})" in text
  assert "Not judged: the goals of stage(s) arms, bank, which the directory does not hold." in text


def test_a_point_an_earlier_stage_already_trained_is_copied_not_trained_again(tmp_path):
  """The same run (same_run) of an earlier stage is copied into a new point's workdir with its evaluation
  but without the time the evaluation took or the lock; a point with a workdir of its own, or no same run, is
  left alone."""
  config_of = lambda **o: resolve("configs/moc.py:tiny", {"train.steps": 450, **o})
  source = tmp_path / "arms" / "routed-prefix-seed0"
  source.mkdir(parents=True)
  for name, text in {"metrics.jsonl": "{}\n", "eval.json": "{}", EVAL_TIME: "{}", ".lock": "1"}.items():
    (source / name).write_text(text)
  earlier = [(config_of(**{"train.eval_every": 450}), str(source))]
  points = [Point(name, {}, config_of(**o)) for name, o in (
      ("steps450-seed0", {"train.eval_every": 1800}), ("kept", {"train.eval_every": 1800}),
      ("steps900-seed0", {"train.steps": 900, "train.eval_every": 1800}))]
  workdirs = [str(tmp_path / "budget" / p.name) for p in points]
  (tmp_path / "budget" / "kept").mkdir(parents=True)
  evidence._reuse(points, workdirs, earlier)
  copied = tmp_path / "budget" / "steps450-seed0"
  assert sorted(f.name for f in copied.iterdir()) == ["eval.json", "metrics.jsonl", evidence.REUSED]
  assert json.loads((copied / evidence.REUSED).read_text()) == {"from": str(source)}
  assert list((tmp_path / "budget" / "kept").iterdir()) == []
  assert sorted(f.name for f in (tmp_path / "budget").iterdir()) == ["kept", "steps450-seed0"]


def test_only_names_points_of_the_stages_run(tmp_path):
  """--only must name points of the stages run (refused before any training); a stage run with some of its points
  says how many of them have finished."""
  with pytest.raises(UsageError, match=r"--only: no points \['routed-prefix-seed0'\] in stage\(s\) budget"):
    evidence.run(str(tmp_path), "configs/moc.py:tiny", True, 1, moc="routed-prefix", stages=["budget"],
                  only=["steps2-seed0", "routed-prefix-seed0"])
  assert list(tmp_path.iterdir()) == []
  budget = _budget(0.60, 0.01, 0.55, 0.015, 900)
  stages = {"budget": {"groups": budget, "wall_s": 1.0, "eval_s": 1.0, "run": True, "done": 4, "points": 6,
                       "reused": 1}}
  text = evidence.markdown("configs/moc.py:tiny", "default", stages, group("routed-prefix"), [], "a machine")
  assert "4 of its 6 runs have finished (--only left the others out)." in text
  assert "1 of its runs is a copy of an earlier stage's identical run (reused.json" in text
