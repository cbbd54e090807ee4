"""The retention harness's arithmetic (experiments/retention.py): forgetting, learning, means and standard errors
over seeds, against hand computations. The harness end to end runs in CI (`python -m experiments.retention
--quick`, .ci/run)."""
import math

import numpy as np
import pytest

from experiments import retention


def scores(recall_a, recall_b, ce=1.0):
  return {"recall_A": recall_a, "recall_B": recall_b, "exact_A": 0.0, "exact_B": 0.0, "ce_A": ce, "chance": 0.25}


def test_forgetting_is_the_share_of_learnt_recall_lost():
  assert retention.forgetting(0.75, 0.5, 0.25) == 0.5
  assert retention.forgetting(0.5, 0.5, 0.25) == 0.0
  assert retention.forgetting(0.55, 0.6, 0.25) < 0  # phase 2 improved A
  assert math.isnan(retention.forgetting(0.25, 0.2, 0.25))  # nothing learnt, nothing to forget


def test_summary_means_and_standard_errors_over_seeds():
  rows = [{"arm": "x", "seed": s, "before": scores(b, 0.25), "after": scores(a, rb)}
          for s, (b, a, rb) in enumerate([(0.75, 0.5, 0.45), (0.65, 0.5, 0.55), (0.85, 0.55, 0.65)])]
  rows.append({"arm": "y", "seed": 0, "before": scores(0.75, 0.25), "after": scores(0.75, 0.35)})
  x, y = retention.summarise(rows)
  f = np.array([0.25 / 0.5, 0.15 / 0.4, 0.3 / 0.6])
  assert x["seeds"] == 3 and y["seeds"] == 1
  np.testing.assert_allclose(x["forgetting"], f.mean())
  np.testing.assert_allclose(x["forgetting_se"], f.std(ddof=1) / np.sqrt(3))
  np.testing.assert_allclose(x["learning"], np.mean([0.2, 0.3, 0.4]))
  np.testing.assert_allclose(x["A_before"], 0.75)
  assert y["forgetting"] == 0 and math.isnan(y["forgetting_se"])
  table = retention.markdown([x, y])
  assert table.count("\n") == 3 and "| x | 3 | 0.750 ± 0.058 | 0.517 ± 0.017 |" in table


def test_the_front_keeps_the_points_nothing_beats():
  points = [(0.1, 0.05), (0.3, 0.2), (0.2, 0.3), (0.5, 0.6), (0.4, 0.1), (0.45, float("nan"))]
  assert retention.pareto_front(points) == [(0.1, 0.05), (0.4, 0.1), (0.5, 0.6)]


def test_matched_learning_interpolates_along_the_front():
  """Learning 0.45 lies between front points (0.4, 0.1) and (0.5, 0.6): forgetting 0.35 by hand. Beyond the front's
  reach: its least forgetting among points within 10% of the level, or None."""
  points = [(0.1, 0.05), (0.3, 0.2), (0.4, 0.1), (0.5, 0.6)]
  assert math.isclose(retention.forgetting_at(points, 0.45), 0.35)
  assert math.isclose(retention.forgetting_at(points, 0.4), 0.1)
  assert retention.forgetting_at(points, 0.55) == 0.6  # 0.5 >= 0.9 x 0.55
  assert retention.forgetting_at(points, 0.6) is None
  assert retention.forgetting_at(points, 0.05) == 0.05  # below the front: its least forgetting that learns as much


def test_each_arm_is_matched_to_full_finetunings_learning():
  """Full finetuning learns 0.3 above chance at best; a family of one point whose seeds learn 0.2 and 0.4
  (forgetting 0.1 and 0.3) forgets 0.2 there on average; one that learns 0.1 does not learn as much."""
  def rows(arm, pairs):
    return [{"arm": arm, "seed": s, "before": scores(0.75, 0.25), "after": scores(0.75 - f * 0.5, 0.25 + l)}
            for s, (l, f) in enumerate(pairs)]
  summary = retention.summarise(rows(retention.FULL_FINETUNING, [(0.3, 0.8), (0.3, 0.8)])
                                + rows("smf", [(0.2, 0.1), (0.4, 0.3)]) + rows("weak", [(0.1, 0.0)]))
  text = retention.matched(summary)
  assert "- smf: forgetting 0.200" in text and "- weak: does not learn as much" in text
  assert f"- {retention.FULL_FINETUNING}: forgetting 0.800" in text
  unlearnt = [{"arm": "none", "seed": 0, "before": scores(0.25, 0.25), "after": scores(0.25, 0.5)}]
  assert "- none: forgetting undefined" in retention.matched(summary + retention.summarise(unlearnt))


def test_the_finetuning_sweep_is_six_families_of_points():
  """Dense and MoC full finetuning and MoC's memory alone at 4 rates; SMF (TF-IDF, SGD) at t 1, 2, 4, 8 x 3 rates;
  its two controls at t 4 x 3 rates; 3 seeds each. The quick size keeps one point of each family."""
  import collections
  from experiments.sweeps.plan import plan
  points = [p for p in plan("configs/moc.py:tiny", "retention_finetune", {"train.init_from": "x"})
            if p.config.seed == 0]
  counts = collections.Counter(retention.family(p.config) for p in points)
  assert counts == {"dense, full finetuning": 4, "MoC, full finetuning": 4, "MoC, the memory alone": 4,
                    "MoC, SMF (TF-IDF), SGD": 12, "MoC, SMF control: random chapters, SGD": 3,
                    "MoC, SMF control: TF alone, SGD": 3}
  assert len(plan("configs/moc.py:tiny", "retention_finetune", {"train.init_from": "x"})) == 90
  smf = [p.config for p in points if retention.family(p.config) == "MoC, SMF (TF-IDF), SGD"]
  assert {(c.train.smf_top_t, c.train.bank_lr, c.train.base_lr, c.data.facts.order) for c in smf} == {
      (t, r, 0.0, "stream") for t in (1, 2, 4, 8) for r in (1.0, 3.0, 10.0)}
  assert retention.knob(smf[0]) == "t 1, lr 1"
  keep = retention.SIZES["quick"]["finetune_points"]
  assert sorted(retention.arm_label(p.config) for p in points if keep(p.overrides)) == [
      "MoC, SMF (TF-IDF), SGD (t 4, lr 3)", "MoC, SMF control: TF alone, SGD (t 4, lr 3)",
      "MoC, SMF control: random chapters, SGD (t 4, lr 3)", "MoC, full finetuning (lr 0.0001)",
      "MoC, the memory alone (lr 0.0001)", "dense, full finetuning (lr 0.0001)"]


def test_phase1_is_met_only_when_a_is_known_and_the_memory_holds_enough_of_it():
  def scores(*pairs):  # (recall of A, its share held by the memory) per seed
    return [{"recall_A": r, "held_A": h} for r, h in pairs]
  met = retention.phase1_verdict(scores((0.95, 0.40), (0.91, 0.30), (0.93, 0.35)))
  assert met["met"] and math.isclose(met["recall"], 0.93) and math.isclose(met["held"], 0.35)
  assert "**met**" in met["text"]
  little = retention.phase1_verdict(scores((0.98, 0.15), (0.97, 0.16), (0.99, 0.14)))  # knows A, holds little
  unknown = retention.phase1_verdict(scores((0.60, 0.50), (0.70, 0.50), (0.65, 0.50)))  # holds, knows too little
  assert not little["met"] and "the memory holds too little" in little["text"]
  assert not unknown["met"] and "does not know A well enough" in unknown["text"]


def test_knocking_the_memory_out_measures_its_share(monkeypatch):
  """held_A = (recall - knocked-out recall) / (recall - chance), the knock-out zeroing every routable chapter."""
  import moc_jax
  from moc_jax.eval import routing as ra
  config = moc_jax.load_config("configs/moc.py:tiny")
  seen = {}

  def zero_chapters(params, mask):
    seen["mask"] = mask
    return "zeroed"
  monkeypatch.setattr(ra, "zero_chapters", zero_chapters)
  probes = lambda params: {"probe_acc": 0.55 if params == "zeroed" else None}
  out = retention._knock_out(config, "params", probes, {"recall_A": 0.85, "chance": 0.25})
  assert math.isclose(out["knocked_A"], 0.55) and math.isclose(out["held_A"], 0.5)
  shared = config.memory.num_shared
  assert seen["mask"][:, :shared].sum() == 0 and seen["mask"][:, shared:config.memory.num_chapters].all()
  dense = moc_jax.load_config("configs/vanilla.py:tiny")
  assert all(map(math.isnan, retention._knock_out(dense, "params", probes, {"recall_A": 0.85}).values()))


def test_the_format_shift_is_the_dense_model_and_moc_with_its_bank_frozen_low_and_equal():
  """The paper's arm: a tenth of tiny's pre-training rate (3e-3) for every group, the bank frozen, at a tenth of that,
  or at it; the chat files the harness writes are its data."""
  from experiments.sweeps.plan import plan
  points = [p.config for p in plan("configs/moc.py:tiny", "retention_format",
                                   {"train.init_from": "x", "data.name": "chat:x_{split}.jsonl"})]
  assert len(points) == 12 and sorted({c.seed for c in points}) == [0, 1, 2]
  arms = {retention.family(c): c.train for c in points if c.seed == 0}
  assert sorted(arms) == [retention.FORMAT_SHIFT + a for a in (
      "MoC, bank at 0.1x", "MoC, bank at the same rate", "MoC, bank frozen", "dense")]
  assert all(t.base_lr == t.memory_lr == pytest.approx(3e-4) for t in arms.values())
  assert arms[retention.FORMAT_SHIFT + "MoC, bank frozen"].freeze_bank
  assert arms[retention.FORMAT_SHIFT + "MoC, bank at 0.1x"].bank_lr == pytest.approx(3e-5)


def test_chat_rows_ask_each_probe_and_answer_it():
  rows = retention.chat_rows([{"prompt": "Ada Lovelace was born in", "answer": "London"}])
  assert rows == [{"messages": [{"role": "user", "content": "Ada Lovelace was born in"},
                                {"role": "assistant", "content": "London"}]}]


def test_the_format_table_compares_each_moc_arm_with_dense_by_welchs_t():
  def row(arm, seed, after, ce_after):
    return {"family": retention.FORMAT_SHIFT + arm, "seed": seed, "before": {"recall_A": 0.85, "ce_A": 1.0},
            "after": {"recall_A": after, "ce_A": ce_after, "chance": 0.25}}
  rows = [row("dense", s, a, 1.2) for s, a in enumerate((0.45, 0.55, 0.50))]
  rows += [row("MoC, bank frozen", s, a, 1.1) for s, a in enumerate((0.70, 0.75, 0.80))]
  rows += [{"family": "MoC, full finetuning", "seed": 0}]  # a stream row: not in this table
  table = retention.format_verdict(rows)
  dense = [(0.85 - a) / 0.6 for a in (0.45, 0.55, 0.50)]
  moc = [(0.85 - a) / 0.6 for a in (0.70, 0.75, 0.80)]
  t = (np.mean(dense) - np.mean(moc)) / math.sqrt(np.var(dense, ddof=1) / 3 + np.var(moc, ddof=1) / 3)
  assert f"| dense | 3 | {np.mean(dense):.3f} ± " in table and "| +0.2000 ± 0.0000 |  |" in table
  assert f"| MoC, bank frozen | 3 | {np.mean(moc):.3f} ± " in table and f"| {t:+.2f} |" in table
  assert "full finetuning" not in table


def test_a_is_scored_as_phase_1_read_it_by_the_runs_own_tree():
  """CE on A's text is measured with phase 1's layout and row length whatever the run trained on (the format shift's
  chat rows, the stream's one document a row), so a rise compares like with like; the cluster tree is the run's."""
  import moc_jax
  phase1 = moc_jax.load_config("configs/moc.py:tiny", {"data.facts.num_entities": 32, "data.cluster.k": 4,
                                                       "memory.routing": "cluster", "memory.cluster_chapters": (4, 3)})
  shift = moc_jax.load_config("configs/moc.py:tiny", {"data.layout": "pad_truncate", "data.seq_len": 96,
                                                      "data.facts.seed": 1, "memory.enabled": False,
                                                      "memory.placement": "none"})
  data = retention._Scorer(phase1.data, {"seed": 1})._a_split(shift)
  assert (data.layout, data.seq_len, data.name) == (phase1.data.layout, phase1.data.seq_len, "moc_facts")
  assert data.facts.to_dict() == phase1.data.facts.to_dict() and data.cluster.k == 0
  assert phase1.data.layout != "pad_truncate" and phase1.data.seq_len != 96  # the test can tell them apart
