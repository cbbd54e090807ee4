"""The capacity study (experiments/capacity.py, configs/capacity.py): the gate's rule and the goal's on hand-made
scores, Welch's t against a hand computation, the config's sizes, and the stage logic (refusals, resuming, a finished
run never trained twice) with training faked. The harness end to end runs in CI (`python -m experiments.capacity
--quick`, .ci/run) and in the slow test below."""
import json
import math
import os
import subprocess
import sys

import pytest

from experiments import capacity
from experiments.sweeps import launch, report
from moc_jax.errors import UsageError

SPEC = "configs/capacity.py:moc"
NARROW = "dense-cooldowns0.5-base_lr0.005-memory_lr0.005"  # at the rate the faked `gate_lr` search chooses
HALF = f"{NARROW}@8"  # its cool-down at half the quick size's 16 steps (the fake below names it so)
WIDE = "dense-d_model128-num_heads8-num_kv_heads4-mlp384-base_lr0.0025-memory_lr0.0025"
QUICK = capacity.SIZES["quick"]


def score(recall, probes=4096):
  return {"recall": recall, "probes": probes}


def checks(verdict):
  return {name: met for name, met, _ in verdict["checks"]}


def test_the_gate_passes_when_learnable_plateaued_and_the_wide_model_holds_more():
  verdict = capacity.gate_verdict(score(0.97, 2304), score(0.52), score(0.51), score(0.70))
  assert verdict["passed"] and checks(verdict) == {"learnable": True, "plateaued": True, "room": True}
  assert "+0.010, +41 of 4,096 probes (needs ≤ +0.02, 81.9 probes, at ≥ 0.35)" in verdict["checks"][1][2]
  assert "+0.180, +17.0 combined standard errors" in verdict["checks"][2][2]


def test_a_rise_one_probe_over_the_bound_fails_and_says_so_in_probes():
  """82 more probes of 4,096 known at all the steps than at half of them: +0.02002, over the +0.02 allowed (81.92
  probes), though both read +0.020 at three digits; 81 more pass."""
  over = capacity.gate_verdict(score(0.97), score(1556 / 4096), score(1474 / 4096), None)
  assert over["lost"] == ["narrow recall 0.360 at half the steps, 0.380 at all of them: +0.020, +82 of 4,096 probes "
                          "(needs ≤ +0.02, 81.9 probes, at ≥ 0.35)"]
  assert checks(capacity.gate_verdict(score(0.97), score(1555 / 4096), score(1474 / 4096), None))["plateaued"]


@pytest.mark.parametrize("preflight, narrow, half, wide, failed", [
    (0.60, 0.52, 0.51, 0.70, "learnable"),  # the backbone cannot learn these facts at all
    (0.97, 0.52, 0.45, 0.70, "plateaued"),  # twice the exposures still buy recall: exposure-bound
    (0.97, 0.26, 0.26, 0.40, "plateaued"),  # flat at chance: the narrow backbone has not started, not filled up
    (0.97, 0.52, 0.51, 0.55, "room"),       # the wide model holds hardly more: not capacity that binds
    (0.97, 0.52, 0.51, 0.58, "room"),       # 6 points, but on too few probes to be clear (2.4 standard errors)
    (0.97, 0.52, 0.51, 0.51, "room"),       # both stuck: the wide model is no better
])
def test_the_gate_fails_each_way(preflight, narrow, half, wide, failed):
  probes = 400 if failed == "room" and wide == 0.58 else 4096
  verdict = capacity.gate_verdict(score(preflight), score(narrow, probes), score(half, probes), score(wide, probes))
  assert not verdict["passed"]
  assert [name for name, met in checks(verdict).items() if not met] == [failed]


def test_a_narrow_run_under_the_floor_fails_the_gate_without_its_other_runs():
  verdict = capacity.gate_verdict(score(0.97), score(0.249), None, None)
  floor = ("narrow recall 0.249 at all the steps, under the floor 0.35: it has not started taking the facts up, "
           "whatever it recalled at half the steps")
  assert not verdict["passed"] and verdict["checks"][1][2] == floor and verdict["lost"] == [floor]
  assert capacity.gate_verdict(score(0.97), score(0.35), None, None)["lost"] == []
  assert capacity.gate_verdict(score(0.97), None, None, None)["lost"] == []  # not known yet


def test_a_check_its_finished_runs_fail_is_lost_whatever_the_missing_runs():
  assert capacity.gate_verdict(score(0.60), None, None, None)["lost"] == ["preflight recall 0.600 (needs ≥ 0.9)"]
  rising = capacity.gate_verdict(score(0.97), score(0.52), score(0.45), None)
  assert rising["lost"] == [("narrow recall 0.450 at half the steps, 0.520 at all of them: +0.070, +287 of 4,096 "
                             "probes (needs ≤ +0.02, 81.9 probes, at ≥ 0.35)")]
  assert capacity.gate_verdict(score(0.97), score(0.52), score(0.51), None)["lost"] == []
  both = capacity.gate_verdict(score(0.60), score(0.52), score(0.51), score(0.53))
  assert [text[:14] for text in both["lost"]] == ["preflight reca", "wide recall 0."]


def test_the_gate_without_its_runs_does_not_pass():
  verdict = capacity.gate_verdict(None, score(0.5), None, None)
  assert checks(verdict) == {"learnable": False, "plateaued": False, "room": False}
  assert [numbers for _, _, numbers in verdict["checks"]] == [
      "no finished preflight", "the narrow run has no cool-down at half its steps (train.cooldowns)",
      "no finished wide run"]
  nothing = capacity.gate_verdict(None, None, None, None)["checks"]
  assert [numbers for _, _, numbers in nothing][1:] == ["no finished narrow run", "no finished narrow and wide runs"]


def test_a_wide_search_run_that_already_holds_clearly_more_meets_the_room_check():
  """The wide backbone's rate-search run (a quarter of the steps) at 0.70 against the narrow run's 0.52: the room
  check is met without the wide run; at 0.55 it is not decided, and not lost (the wide run may still show room); the
  wide run, once finished, decides whatever its search run showed."""
  early = capacity.gate_verdict(score(0.97), score(0.52), score(0.51), None, score(0.70))
  assert early["passed"] and early["room_early"] and early["lost"] == []
  assert early["checks"][2][2].startswith("wide recall 0.700 after a quarter of the steps (its rate search's run) "
                                          "against narrow 0.520 after all of them: +0.180, +17.0 combined")
  short = capacity.gate_verdict(score(0.97), score(0.52), score(0.51), None, score(0.55))
  assert not short["passed"] and not short["room_early"] and short["lost"] == []
  assert short["checks"][2][2] == "no finished wide run"
  full = capacity.gate_verdict(score(0.97), score(0.52), score(0.51), score(0.53), score(0.70))
  assert not full["passed"] and not full["room_early"] and full["lost"][0].startswith("wide recall 0.530 against")
  assert not capacity.gate_verdict(score(0.97), None, None, None, score(0.70))["room_early"]


def test_welch_t_against_a_hand_computation():
  a, b = [0.62, 0.60, 0.65], [0.50, 0.55, 0.49]
  mean_a, mean_b = sum(a) / 3, sum(b) / 3
  var_a = sum((x - mean_a) ** 2 for x in a) / 2
  var_b = sum((x - mean_b) ** 2 for x in b) / 2
  t = (mean_a - mean_b) / math.sqrt(var_a / 3 + var_b / 3)
  df = (var_a / 3 + var_b / 3) ** 2 / ((var_a / 3) ** 2 / 2 + (var_b / 3) ** 2 / 2)
  assert report.welch_t(a, b) == pytest.approx((t, df))


def test_the_goal_needs_t_and_a_memory_that_holds_the_recall():
  dense = [{"recall": r} for r in (0.50, 0.55, 0.49)]
  memory = [{"recall": r, "knockout": k} for r, k in ((0.62, 0.30), (0.60, 0.33), (0.65, 0.28))]
  goal = capacity.goal_verdict(memory, dense)
  assert goal["met"] and goal["t"] > 3
  assert goal["held"] == pytest.approx((0.62333 - 0.30333) / (0.62333 - 0.25), rel=1e-4)
  weak = [{**m, "knockout": m["recall"] - 0.1} for m in memory]  # the backbone holds most of it
  assert not capacity.goal_verdict(weak, dense)["met"]
  close = [{"recall": r, "knockout": 0.25} for r in (0.56, 0.50, 0.55)]  # held, but not clearly ahead
  assert not capacity.goal_verdict(close, dense)["met"]


def test_the_config_sizes_the_study_from_capacity():
  """The narrow backbone cannot hold the default corpus's facts at 1 bit per parameter; the wide one can; the memories
  are of one size; every biography fits its row whole; the iso-FLOP dense model is within 2% of the MoC arm's FLOPs."""
  from moc_jax import count_params, load_config
  from moc_jax.data.facts import fact_bits
  from moc_jax.flops import model_flops_per_token
  narrow, wide, moc = (load_config(f"configs/capacity.py:{n}") for n in ("dense", "wide", "moc"))
  bits = fact_bits(narrow.data.facts)["total"]
  embedding = lambda c: c.model.vocab_size * c.model.d_model
  assert count_params(narrow)["backbone"] - embedding(narrow) < bits / 1.5
  assert count_params(wide)["backbone"] - embedding(wide) > 2 * bits
  assert count_params(moc)["bank"] > 2 * (count_params(narrow)["backbone"] - embedding(narrow))
  for kind in ("pkm", "hml", "cluster", "ffn"):  # every memory within 15% of the bank's size
    memory = count_params(load_config(f"configs/capacity.py:{kind}"))["bank"]
    assert memory == pytest.approx(count_params(moc)["bank"], rel=0.15), kind
  assert narrow.data.seq_len >= 183  # the longest biography and its EOS
  iso = load_config("configs/capacity.py:iso")
  assert model_flops_per_token(iso) / model_flops_per_token(moc) == pytest.approx(1, abs=0.02)
  assert not iso.memory.enabled and iso.model.d_model == narrow.model.d_model


def test_in_words_the_study_is_sized_for_the_d32_backbone():
  """`words` (SHAPES["facts"]): the narrow backbone is d 32 at twice the byte backbone's rate, the wide one the byte
  study's narrow d 64 at its rate; at the default study's 8,192 entities the narrow backbone has 14.2 bits of facts per
  parameter (hand count: 8,192 x 42.97 / 24,736); each memory within 15% of the bank's 129 x 16 x 32; the iso-FLOP
  dense model within 2% of the costliest arm's FLOPs."""
  from moc_jax import count_params, load_config
  from moc_jax.data.facts import fact_bits
  from moc_jax.flops import model_flops_per_token
  load = lambda name: load_config(f"configs/capacity.py:{name},words,entities=8192,readings=400,ramp=25600")
  narrow, wide, moc, iso = (load(n) for n in ("dense", "wide", "moc", "iso"))
  without_embedding = lambda c: count_params(c)["backbone"] - c.model.vocab_size * c.model.d_model
  assert (narrow.model.d_model, narrow.train.base_lr, wide.model.d_model, wide.train.base_lr) == (32, 0.01, 64, 0.005)
  assert (without_embedding(narrow), without_embedding(wide)) == (24736, 98624)
  assert fact_bits(narrow.data.facts)["total"] / without_embedding(narrow) == pytest.approx(8192 * 42.97 / 24736,
                                                                                              rel=1e-3)
  assert count_params(moc)["bank"] == 129 * 16 * 32
  for kind in ("pkm", "hml", "cluster", "ffn"):
    assert count_params(load(kind))["bank"] == pytest.approx(129 * 16 * 32, rel=0.15), kind
  costliest = max(model_flops_per_token(load(k)) for k in ("moc", "pkm", "hml", "cluster", "ffn"))
  assert model_flops_per_token(iso) / costliest == pytest.approx(1, abs=0.02) and not iso.memory.enabled


def test_narrow_16_sizes_the_study_for_a_d16_backbone_whose_wide_one_is_d32():
  """`narrow=16`: the narrow backbone is d 16 (hand count without its embedding: 2 layers of q 16 x 16, k and v 16 x
  8, o 16 x 16, SwiGLU 3 x 16 x 48 and 2 norms of 16, and the final norm: 2 x 3,104 + 16 = 6,224), the wide one the
  d 32 backbone of the default words size (24,736) at half the narrow one's rate (a third of d 32's: the search
  starts near the pilot's best); the bank 65 x 16 x 16; each memory within 15% of
  it; the iso-FLOP dense model within 2% of the costliest arm's FLOPs; a width the study does not size is one error."""
  from moc_jax import count_params, load_config
  from moc_jax.flops import model_flops_per_token
  load = lambda name: load_config(f"configs/capacity.py:{name},words,narrow=16,entities=8192,readings=400,ramp=25600")
  narrow, wide, moc, iso = (load(n) for n in ("dense", "wide", "moc", "iso"))
  without_embedding = lambda c: count_params(c)["backbone"] - c.model.vocab_size * c.model.d_model
  assert (narrow.model.d_model, narrow.train.base_lr, wide.model.d_model, wide.train.base_lr) == (16, 1e-2 / 3, 32,
                                                                                                  1e-2 / 6)
  assert (without_embedding(narrow), without_embedding(wide)) == (2 * (256 + 128 + 128 + 256 + 3 * 16 * 48 + 32) + 16,
                                                                   24736)
  assert narrow.name == "capacity-dense-bound-e8192-ramp25600-words-n16"
  assert count_params(moc)["bank"] == 65 * 16 * 16
  for kind in ("pkm", "hml", "cluster", "ffn"):
    assert count_params(load(kind))["bank"] == pytest.approx(65 * 16 * 16, rel=0.15), kind
  costliest = max(model_flops_per_token(load(k)) for k in ("moc", "pkm", "hml", "cluster", "ffn"))
  assert model_flops_per_token(iso) / costliest == pytest.approx(1, abs=0.02) and not iso.memory.enabled
  subject, cluster = load("subject").to_dict(), load("cluster").to_dict()
  assert subject["data"]["cluster"].pop("words") == 2 and cluster["data"]["cluster"].pop("words") == 0
  assert {**subject, "name": None} == {**cluster, "name": None}  # the cluster arm's bank, read by the subject's path
  assert load_config("configs/capacity.py:dense,words,narrow=32").to_dict() == load_config(
      "configs/capacity.py:dense,words").to_dict()
  for bad in ("words,narrow=24", "words,narrow=16,narrow=32", "narrow=16"):
    with pytest.raises(ValueError, match=r"give one `narrow=D`, D a width the study sizes in (words: 16 or 32|bytes: "
                                         r"64) \(e.g. `configs/capacity.py:moc,words,narrow=16`\)"):
      load_config(f"configs/capacity.py:dense,{bad}")


def test_words_rows_hold_every_biography_of_the_study_whole_and_never_two():
  """`words`: the longest biography the default corpus can write (its longest name in tokens, the colon, every
  attribute's key and its longest value, 8 semicolons and the full stop) and its EOS fit WORD_ROW; the shortest is
  over half a row. Counted from the tokenizer on every name and value, not from the documents the seed drew."""
  from moc_jax import load_config
  from moc_jax.data.facts import ATTRIBUTES, BIOGRAPHY_KEYS, MocFactsConfig, generate
  from moc_jax.data.tokenizers import get_tokenizer
  words = load_config("configs/capacity.py:dense,words")
  tok = get_tokenizer(words.data.tokenizer)
  assert (words.data.seq_len, words.model.max_seq_len, words.model.vocab_size) == (36, 36, tok.vocab_size)
  facts = words.data.facts.copy_and_resolve_references()
  facts.update(num_docs=facts.num_entities, warmup_entities=0, warmup_docs=0, ramp_docs=0)
  names = {p["entity"] for p in generate(MocFactsConfig.for_sizes(facts))["probes"]}
  assert len(names) == 4096
  name_tokens = [len(tok.encode(n)) for n in names]
  clause = lambda attr, pick: 1 + pick(len(tok.encode(f" {v}")) for v in ATTRIBUTES[attr][0])  # key, value
  longest = max(name_tokens) + 1 + sum(clause(a, max) for a in BIOGRAPHY_KEYS) + len(BIOGRAPHY_KEYS) + 1  # EOS
  shortest = min(name_tokens) + 1 + sum(clause(a, min) for a in BIOGRAPHY_KEYS) + len(BIOGRAPHY_KEYS) + 1
  assert (max(name_tokens), longest, shortest) == (6, 36, 34)
  assert longest <= words.data.seq_len < 2 * shortest


def test_bound_reads_each_entity_eight_times_as_often_in_as_many_more_steps():
  from moc_jax import load_config
  default, bound = load_config("configs/capacity.py:dense"), load_config("configs/capacity.py:dense,bound")
  assert bound.data.facts.num_docs == 4096 * 400 == 8 * default.data.facts.num_docs
  assert bound.data.facts.num_entities == default.data.facts.num_entities
  assert bound.train.steps == 8 * default.train.steps == 51_200 and bound.train.warmup_steps == 1600
  assert (bound.train.eval_every, bound.train.checkpoint_every) == (12_800, 3200)
  assert bound.name == "capacity-dense-bound"
  with pytest.raises(ValueError, match="unknown modifiers.*'huge'.*takes `bound`, `words`, `readings=N`, "
                                       "`entities=N`, `warm=N`, `ramp=N` and `narrow=D`"):
    load_config("configs/capacity.py:moc,huge")


def test_the_preflight_reads_its_entities_as_often_as_the_study_and_shorter_runs_have_their_own_schedule():
  """At `bound`: the study's 1,638,400 documents begin with 800 updates of 32 (25,600) about 64 entities, then
  (1,638,400 - 25,600) // 4,096 = 393 readings of each; the preflight's 256 entities the same curriculum and readings:
  25,600 + 256 x 393 = 126,208 documents, 3,944 updates, a 32nd of them warm-up, 4 evaluations, 16 checkpoints. The
  `lr` sweep's quarter scales its schedule (and a short run's curriculum: a quarter); the gate's narrow run is cooled
  down at half its steps: from update 0.8 x 25,600 = 20,480 to 25,600."""
  from experiments.sweeps.plan import plan
  (pre,) = plan("configs/capacity.py:moc,bound", "preflight")
  f, t = pre.config.data.facts, pre.config.train
  assert (f.num_entities, f.num_docs, f.warmup_entities, f.warmup_docs) == (256, 126_208, 64, 25_600)
  assert (t.steps, t.warmup_steps, t.eval_every, t.checkpoint_every) == (3944, 123, 986, 246)
  assert not pre.config.memory.enabled and pre.name == "dense-num_entities256-num_docs126208-warmup_entities64-steps3944"
  from moc_jax.config.plan import cooldown_branches
  narrow = plan("configs/capacity.py:moc,bound", "gate")[0].config
  assert (narrow.train.steps, cooldown_branches(narrow.train)) == (51_200, {20_480: 25_600})
  quarter = plan(SPEC, "lr")[0].config  # 6,400 steps at the default size: 1,600
  assert (quarter.train.steps, quarter.train.warmup_steps, quarter.train.eval_every, quarter.train.checkpoint_every,
          quarter.data.facts.warmup_docs) == (1600, 50, 400, 100, 400 * 32)


@pytest.mark.parametrize("arg, entities, readings, name", [
    ("dense,bound,entities=1024", 1024, 400, "capacity-dense-bound-e1024"),
    ("dense,readings=800,entities=512", 512, 800, "capacity-dense-r800-e512")])
def test_entities_and_readings_scale_the_steps(arg, entities, readings, name):
  """409,600 documents either way: 12,800 steps of 32, a 32nd of them warm-up, 4 evaluations, 16 checkpoints."""
  from moc_jax import load_config
  c = load_config(f"configs/capacity.py:{arg}")
  assert (c.data.facts.num_entities, c.data.facts.num_docs) == (entities, entities * readings) == (entities, 409_600)
  assert (c.train.steps, c.train.warmup_steps, c.train.eval_every, c.train.checkpoint_every) == (12_800, 400, 3200, 800)
  assert c.name == name


def test_a_bad_entities_is_one_error_naming_the_least():
  from moc_jax import load_config
  # 21 entities x 50 readings / 32 rows = 32 steps (one of warm-up); 20 would give 31
  assert load_config("configs/capacity.py:dense,entities=21").train.steps == 32
  for bad in ("entities=20", "entities=many", "entities=64,entities=128"):
    with pytest.raises(ValueError, match=r"give one `entities=N`, N a whole number of at least 21"):
      load_config(f"configs/capacity.py:dense,{bad}")


def test_warm_reads_n_entities_first_for_its_steps():
  """By default (and with warm=64) the first 800 updates of 32 rows (25,600 documents) are about 64 entities, read in
  order; a short run's first quarter; the preflight's fewer entities cap it; a name says when it is not 64; warm=0
  (or a corpus of at most 64 entities) has no curriculum."""
  from moc_jax import load_config
  c = load_config("configs/capacity.py:dense,readings=200,entities=2048")
  assert (c.data.facts.warmup_entities, c.data.facts.warmup_docs, c.data.shuffle) == (64, 800 * 32, False)
  assert load_config("configs/capacity.py:dense,readings=200,entities=2048,warm=64").to_dict() == c.to_dict()
  assert c.name == "capacity-dense-r200-e2048"
  short = load_config("configs/capacity.py:dense,readings=50,entities=512,warm=32")  # 800 steps: 200 of them
  assert (short.train.steps, short.data.facts.warmup_docs, short.data.facts.warmup_entities) == (800, 200 * 32, 32)
  assert short.name == "capacity-dense-e512-w32"
  assert load_config("configs/capacity.py:preflight,entities=256").data.facts.warmup_entities == 32
  for none in ("dense,warm=0", "dense,entities=64"):
    c = load_config(f"configs/capacity.py:{none}")
    assert (c.data.facts.warmup_entities, c.data.facts.warmup_docs, c.data.shuffle) == (0, 0, True)
  assert load_config("configs/capacity.py:dense,warm=0").name == "capacity-dense-w0"
  with pytest.raises(ValueError, match=r"`warm=512`: give fewer entities than the corpus's 512"):
    load_config("configs/capacity.py:dense,entities=512,warm=512")
  with pytest.raises(ValueError, match=r"give one `warm=N`, N a whole number of at least 0 \(e.g. `configs/capacity"
                     r".py:moc,readings=200,entities=2048,warm=64`\)"):
    load_config("configs/capacity.py:dense,warm=some")


def test_ramp_grows_the_entities_after_the_curriculum_and_shorter_runs_scale_it():
  """ramp=3200 at 100 readings (12,800 updates of 32 rows): 102,400 documents after the curriculum's 25,600 about a
  growing set; the preflight (3,944 of 51,200 updates: 126,208 of 1,638,400 documents) keeps it in proportion, by
  hand, and the gate's runs are the whole run's; a ramp without a curriculum, or longer than the updates after it, is
  one error."""
  from moc_jax import load_config
  c = load_config("configs/capacity.py:dense,readings=100,ramp=3200")
  assert (c.train.steps, c.data.facts.warmup_docs, c.data.facts.ramp_docs, c.data.shuffle) == (12_800, 25_600,
                                                                                                102_400, False)
  assert c.name == "capacity-dense-r100-ramp3200"
  assert load_config("configs/capacity.py:dense,readings=100").data.facts.ramp_docs == 0
  from experiments.sweeps.plan import plan
  gate = plan("configs/capacity.py:moc,bound,ramp=12800", "gate")
  dense, wide = (next(p for p in gate if capacity._narrow(p) == n).config.data.facts for n in (True, False))
  assert (dense.ramp_docs, wide.ramp_docs) == (409_600, 409_600)
  (pre,) = plan("configs/capacity.py:moc,bound,ramp=12800", "preflight")
  assert (pre.config.data.facts.num_docs, pre.config.data.facts.ramp_docs) == (126_208, 31_552)  # 409,600 / 12.98
  with pytest.raises(ValueError, match=r"`ramp=3200`: a ramp grows the curriculum's entities .* leave out `warm=0`"):
    load_config("configs/capacity.py:dense,ramp=3200,warm=0")
  with pytest.raises(ValueError, match=r"`ramp=12001`: give at most the 12000 updates after the curriculum's"):
    load_config("configs/capacity.py:dense,readings=100,ramp=12001")


def test_readings_of_400_is_bound_and_a_bad_readings_is_one_error():
  from moc_jax import load_config
  # the gate's cool-down at half of 800 readings ends where `bound`'s whole run does
  assert load_config("configs/capacity.py:dense,readings=800,entities=512").train.steps // 2 == load_config(
      "configs/capacity.py:dense,bound,entities=512").train.steps
  assert load_config("configs/capacity.py:dense,readings=400").to_dict() == load_config(
      "configs/capacity.py:dense,bound").to_dict()
  # 1,024 rows of 10 readings: 32 steps
  assert load_config("configs/capacity.py:dense,readings=10,entities=103").train.steps == 32
  with pytest.raises(ValueError, match=r"give one `entities=N`, N a whole number of at least 103"):
    load_config("configs/capacity.py:dense,readings=10,entities=102")
  for bad in ("readings=0", "readings=lots", "readings=100,readings=200"):
    with pytest.raises(ValueError, match=r"give one `readings=N`, N a whole number of at least 1 "):
      load_config(f"configs/capacity.py:dense,{bad}")
  with pytest.raises(ValueError, match=r"give `bound` \(400 readings per entity\) or `readings=N`, not both"):
    load_config("configs/capacity.py:dense,bound,readings=800")


def test_the_sweeps():
  from experiments.sweeps.plan import plan
  gate = plan(SPEC, "gate")
  assert len(gate) == 12 and {NARROW, WIDE} <= {p.name for p in gate}
  searched = {p.name for p in plan(SPEC, "gate_lr")}
  assert len(searched) == 12 and {"dense-base_lr0.005-memory_lr0.005-steps1600", WIDE + "-steps1600"} <= searched
  lr = plan(SPEC, "lr")
  arms = {capacity.arm_of(p.overrides, {}) for p in lr}
  assert {"routed-prefix-attention", "dense-mlp432"} <= arms and len(lr) == 6 * len(arms)
  assert sorted(p.config.train.base_lr for p in lr if p.name.startswith("dense-mlp432")) == list(RUNGS)
  assert {p.config.train.steps for p in lr} == {1600}
  confirm = plan(SPEC, "confirm", only=["routed-prefix-attention-base_lr0.005-memory_lr0.005-corpus2-seed1"])
  assert (confirm[0].config.seed, confirm[0].config.data.facts.seed) == (1, 2)


RUNGS = (0.000185, 0.000556, 0.00167, 0.005, 0.015, 0.045)  # SPEC's rate 5e-3 times 1/27 ... 9, to 3 digits


def _search(recalls):
  """lr_search over SPEC's `lr` points, `recalls` {(arm, rate): recall} the finished runs."""
  from experiments.sweeps.plan import plan
  runs = [{"status": "done", "arm": arm, "lr": rate, "recall": recall, "val_ce": 1.0}
          for (arm, rate), recall in recalls.items()]
  todo, search = capacity.lr_search(plan(SPEC, "lr"), runs, {})
  return {(capacity.arm_of(p.overrides, {}), p.config.train.base_lr) for p in todo}, search


@pytest.mark.parametrize("recalls, rates, best, state", [
    ({}, RUNGS[2:4], None, "searching"),  # the arm's rate and the one below first
    ({RUNGS[2]: 0.4, RUNGS[3]: 0.3}, RUNGS[1:4], 0.00167, "searching"),  # the lower is better: one rung lower
    ({RUNGS[1]: 0.35, RUNGS[2]: 0.4, RUNGS[3]: 0.3}, RUNGS[1:4], 0.00167, "bracketed"),
    ({RUNGS[2]: 0.3, RUNGS[3]: 0.4}, RUNGS[2:5], 0.005, "searching"),  # the higher is better: one rung higher
    ({RUNGS[2]: 0.3, RUNGS[3]: 0.4, RUNGS[4]: 0.5}, RUNGS[2:6], 0.015, "searching"),
    ({RUNGS[2]: 0.3, RUNGS[3]: 0.4, RUNGS[4]: 0.5, RUNGS[5]: 0.6}, RUNGS[2:6], 0.045, "at the ladder's end"),
    ({RUNGS[2]: 0.4, RUNGS[3]: 0.4}, RUNGS[1:4], 0.00167, "searching"),  # a tie: the lower CE, here the first
    ({x: 0.5 - i * 0.01 for i, x in enumerate(RUNGS)}, RUNGS[:4], 0.000185, "at the ladder's end"),
])
def test_the_lr_search_brackets_each_arms_best_rate(recalls, rates, best, state):
  """One arm's finished runs decide its next rung (the other arms, with none, start at theirs); hand-decided."""
  arm = "dense-mlp432"
  todo, search = _search({(arm, x): recall for x, recall in recalls.items()})
  assert {x for a, x in todo if a == arm} == set(rates)
  assert search[arm] == {"rates": list(rates), "best": best, "state": state}
  assert {x for a, x in todo if a == "routed-prefix-attention"} == set(RUNGS[2:4])


def test_every_quick_run_of_the_default_study_has_a_corpus_its_shapes_can_build():
  """The quick size replaces the corpus's sizes with its own, the default's ramp included (409,600 documents would
  outgrow its 64): CI's `--quick` run trains the default config's stages on corpora moc_facts accepts."""
  from moc_jax.data.facts import fact_bits
  for stage in capacity.STAGES:
    for sweep in capacity.SWEEPS[stage]:
      for p in capacity._plan(capacity.DEFAULT_CONFIG, sweep, QUICK):
        assert fact_bits(p.config.data.facts)["entities"] <= 16, p.name


# ---- the stage logic, with training faked -------------------------------------------------------------------

def _fake_training(trained, recall, fails=()):
  """subprocess.Popen of moc_jax.main for the launcher: writes the run's config.json (the command's config, parsed as
  moc_jax.main parses it), a validation row at step 0 and at the end (recall(name)) and a row per cool-down of the
  config (recall(f"{name}@{its end}")), and records the run's name; a run named in `fails` stops before its end
  (exit 1)."""
  from absl import flags
  from ml_collections import config_flags

  from moc_jax.config.plan import cooldown_branches

  class Run:
    def __init__(self, cmd, **kw):
      argv = ["main", *(a for a in cmd if a.startswith("--config"))]
      values = flags.FlagValues()
      config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
      values(argv)
      workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
      trained.append(os.path.basename(workdir))
      with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(values.config.to_json())
      steps = values.config.train.steps
      self.rc = int(trained[-1] in fails)
      if self.rc:
        return
      rows = [{"step": s, "split": "validation", "probe_acc": a} for s, a in ((0, 0.25), (steps, recall(trained[-1])))]
      rows += [{"step": start, "split": "cooldown", "cooldown_end": end, "probe_acc": recall(f"{trained[-1]}@{end}")}
               for start, end in cooldown_branches(values.config.train).items()]
      with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({**r, "ce": 1.0, "probe_exact": 0.0, "num_probes": 4096}) + "\n" for r in rows)

    def wait(self):
      return self.rc
  return Run


def fake_recall(recalls, name):
  """The faked runs' recall: what `recalls` says, else the preflight 0.95, the others 0.5, +0.1 at the rate 0.005
  (the wide backbone's: 0.0025), +0.05 with memory, +0.01 on the second seed."""
  if name in recalls:
    return recalls[name]
  if name.startswith("dense-num_entities"):
    return 0.95
  return (0.5 + 0.1 * ("base_lr0.005-" in name or "base_lr0.0025-" in name)
                     + 0.05 * (not name.startswith("dense")) + 0.01 * name.endswith("corpus2-seed1"))


@pytest.fixture
def faked(monkeypatch):
  """Training and evaluation faked: recall as fake_recall says, the gate's runs what `recalls` says (a passing gate
  by default); a knock-out leaves 0.3."""
  trained, evaluated = [], []
  recalls = {NARROW: 0.5, HALF: 0.49, WIDE: 0.7}

  def recall(name):
    return fake_recall(recalls, name)

  def evaluate_runs(runs, parallel, harness):
    for workdir, memory in runs:
      if os.path.exists(os.path.join(workdir, "eval.json")):  # as the real one, a run evaluated already is not
        continue
      evaluated.append(os.path.basename(workdir))
      with open(os.path.join(workdir, "eval.json"), "w") as f:
        json.dump({"ablation": {"spec": "routed", "fact_recall": {"probe_acc": 0.3}}}, f)
  monkeypatch.setattr(launch.subprocess, "Popen", _fake_training(trained, recall))
  monkeypatch.setattr(capacity, "evaluate_runs", evaluate_runs)
  monkeypatch.setattr(capacity, "plot_curves", lambda *a: None)
  return trained, evaluated, recalls


def test_a_bad_stage_is_refused_before_anything_runs(tmp_path):
  with pytest.raises(UsageError, match="--stages=gate,gat: name one or more of preflight, gate, arms, confirm"):
    capacity.run(str(tmp_path), SPEC, True, 1, stages=["gate", "gat"])
  assert list(tmp_path.iterdir()) == []


def test_a_bad_stage_is_one_error_line_and_exit_2(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.capacity", f"--out={tmp_path}", "--stages=gat"],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: --stages=gat: name one or more of preflight, gate, arms, confirm"]


# The faked gate_lr search: each backbone at its rate and a third of it, then (its rate being the best) at three times
# it; then the gate's runs at the rates it chose.
_WIDE_ARM = "dense-d_model128-num_heads8-num_kv_heads4-mlp384"
GATE_LR = [f"{model}-base_lr{r}-memory_lr{r}-steps4" for model, r in (
    ("dense", "0.005"), ("dense", "0.00167"), (_WIDE_ARM, "0.0025"), (_WIDE_ARM, "0.000833"),
    ("dense", "0.015"), (_WIDE_ARM, "0.0075"))]
# The wide backbone's search run at its chosen rate (0.6) already beats the narrow run (0.5) by the room check's
# margins, so its full run (WIDE) is not trained.
GATE_RUNS = ["dense-num_entities2-num_docs128-warmup_entities2-steps32", *GATE_LR, NARROW]


def test_a_stage_resumes_and_a_finished_run_is_never_trained_twice(tmp_path, faked):
  trained, _, _ = faked
  out = str(tmp_path)
  os.makedirs(tmp_path / "gate" / NARROW)  # a run stopped before its end: run again (moc_jax.main resumes it)
  capacity.run(out, SPEC, True, 1, stages=["preflight", "gate"])
  assert trained == GATE_RUNS
  text = capacity.run(out, SPEC, True, 1, stages=["preflight", "gate"])
  assert trained == GATE_RUNS  # every run had finished: none trained again
  assert "## The gate: **passed**" in text
  assert "Not run by this invocation" not in text
  text = capacity.run(out, SPEC, True, 1, stages=["preflight"])
  assert text.count("Not run by this invocation: what DIR holds.") == 2  # the gate's search and runs, from DIR


def test_the_facts_a_model_holds_are_the_share_of_probes_it_knows_above_chance():
  assert capacity.held_kbit(0.625, 8000) == pytest.approx(4.0)  # (0.625 - 0.25) / 0.75 = half of 8 kbit
  assert capacity.held_kbit(1.0, 8000) == pytest.approx(8.0)
  assert capacity.held_kbit(0.2, 8000) == 0.0  # under chance: nothing held, not a negative amount


def test_the_runs_table_states_the_facts_each_run_and_cool_down_holds(tmp_path, faked):
  """The faked narrow run recalls 0.5 (a third of the probes known above chance), its cool-down 0.49: the quick
  corpus's 16 entities x 42.97 bits = 687.5 bit (hand count: Σ log2 of the nine pools, tests/data), per parameter
  over the narrow backbone's 98,624 without the embedding (configs/capacity.py's sizing)."""
  text = capacity.run(str(tmp_path), SPEC, True, 1, stages=["preflight", "gate"])
  assert "| 0.500 ± 0.008 | 0.000 | 0.229 of 0.688 (0.00232) |" in text
  assert "| 0.490 ± 0.008 | 0.000 | 0.22 of 0.688 (0.00223) |" in text


def test_the_report_counts_what_another_invocation_sharing_dir_finished_meanwhile(tmp_path, faked, monkeypatch):
  """`--stages=gate` started before the preflight (another invocation, same DIR) finished: the gate's verdict and
  the report read DIR when written, not when the command started."""
  trained, _, _ = faked
  out, run_sweep = str(tmp_path), capacity._run_sweep

  def gate_beside_the_preflight(out, spec, sweep, points, parallel, size):
    if sweep == "gate_lr":  # the other invocation finishes the preflight while the gate trains
      run_sweep(out, spec, "preflight", capacity._plan(spec, "preflight", size), parallel, size)
    return run_sweep(out, spec, sweep, points, parallel, size)

  monkeypatch.setattr(capacity, "_run_sweep", gate_beside_the_preflight)
  text = capacity.run(out, SPEC, True, 1, stages=["gate"])
  assert trained == GATE_RUNS
  assert "| learnable | yes |" in text and "## The gate: **passed**" in text
  assert text.count("Not run by this invocation: what DIR holds.") == 1  # the preflight


def test_a_run_that_stops_short_stops_the_command_after_the_report(tmp_path, faked, monkeypatch):
  """The wide run fails: the command stops as the launcher says, and capacity.md already gives the plateau check
  the narrow run decides with its cool-down (here failing: +0.3 from half the steps)."""
  trained, _, recalls = faked
  recalls.update({HALF: 0.2, GATE_LR[2]: 0.52})  # the wide search's best, under the room check's margin: WIDE trains
  monkeypatch.setattr(launch.subprocess, "Popen", _fake_training(trained, lambda name: fake_recall(recalls, name),
                                                                 fails={WIDE}))
  with pytest.raises(SystemExit, match=r"gate finished 1 of 2 runs .*re-run the same command"):
    capacity.run(str(tmp_path), SPEC, True, 1, stages=["gate"])
  text = (tmp_path / "capacity.md").read_text()
  assert "| plateaued | **no** | narrow recall 0.200 at half the steps, 0.500 at all of them: +0.300" in text
  assert "| room | **no** | no finished wide run |" in text and "## The gate: **not passed**" in text


def test_arms_refuse_to_run_without_a_passed_gate(tmp_path, faked, monkeypatch):
  """At the default size's rules (here with the quick size's shapes) stage arms is refused, after the report, while
  DIR holds no gate, and while the gate it holds fails (here on its plateau: exposure-bound)."""
  trained, _, recalls = faked
  out = str(tmp_path)
  monkeypatch.setitem(capacity.SIZES, "default", QUICK)
  with pytest.raises(UsageError, match="stage arms not run: the gate has not passed .no finished preflight"):
    capacity.run(out, SPEC, False, 1, stages=["arms"])
  assert trained == [] and "Stopped: stage arms not run" in (tmp_path / "capacity.md").read_text()
  recalls[HALF] = 0.40
  with pytest.raises(UsageError, match="stage gate stopped: narrow recall 0.400"):
    capacity.run(out, SPEC, False, 1, stages=["preflight", "gate", "arms"])
  assert trained == GATE_RUNS
  with pytest.raises(UsageError, match="stage arms not run: the gate has not passed .narrow recall 0.400"):
    capacity.run(out, SPEC, False, 1, stages=["arms"])
  assert trained == GATE_RUNS
  with pytest.raises(UsageError, match="stage confirm not run: the gate has not passed"):
    capacity.run(out, SPEC, False, 1, stages=["confirm"])


def test_a_gate_whose_narrow_run_ended_under_the_floor_trains_nothing_more(tmp_path, faked, monkeypatch):
  """At the default size's rules: the narrow run finished at 0.26, under the floor, whatever its cool-down recalled:
  the stage stops with one line instead of training the wide run, and run again it trains nothing, since no wide run
  can make the gate pass."""
  trained, _, recalls = faked
  out = str(tmp_path)
  monkeypatch.setitem(capacity.SIZES, "default", QUICK)
  recalls.update({NARROW: 0.26, HALF: 0.26})
  with pytest.raises(UsageError, match=r"^stage gate stopped: narrow recall 0.260 at all the steps, under the floor"):
    capacity.run(out, SPEC, False, 1, stages=["gate"])
  assert trained == [*GATE_LR, NARROW]
  del trained[:]
  with pytest.raises(UsageError, match=r"^stage gate stopped: narrow recall 0.260 at all the steps, under the floor "
                                       r"0.35: .*the gate cannot pass, so its other runs are not trained"):
    capacity.run(out, SPEC, False, 1, stages=["gate"])
  assert trained == []


def test_a_gate_that_cannot_pass_trains_no_more_of_its_runs(tmp_path, faked, monkeypatch):
  """At the default size's rules: a preflight under 0.9 stops the gate before its runs; one that learns lets the
  narrow run train first, and its failed plateau check (+0.07 from its cool-down at half the steps) leaves the wide run
  untrained."""
  trained, _, recalls = faked
  monkeypatch.setitem(capacity.SIZES, "default", QUICK)
  recalls.update({GATE_RUNS[0]: 0.6, NARROW: 0.52, HALF: 0.45})
  with pytest.raises(UsageError, match=r"^stage gate stopped: preflight recall 0.600 \(needs ≥ 0.9\); the gate "
                                       r"cannot pass, so its other runs are not trained \(the levers: "):
    capacity.run(str(tmp_path), SPEC, False, 1, stages=["preflight", "gate"])
  assert trained == GATE_RUNS[:1]
  recalls[GATE_RUNS[0]] = 0.95
  with pytest.raises(UsageError, match=r"^stage gate stopped: narrow recall 0.450 at half the steps, 0.520 at all "
                                       r"of them: \+0.070"):
    capacity.run(str(tmp_path / "learns"), SPEC, False, 1, stages=["preflight", "gate"])
  assert trained == GATE_RUNS[:1] + GATE_RUNS
  text = (tmp_path / "learns" / "capacity.md").read_text()
  assert "| room | yes | wide recall 0.600 after a quarter of the steps" in text  # its search run shows room
  assert "Stopped: stage gate stopped: narrow recall" in text


def test_the_whole_pipeline_with_training_faked(tmp_path, faked):
  """Every stage at the quick size: each arm trained for a quarter of the steps at its rate and a third of it, then
  (its rate being the best) at three times it, then at the rate with the best recall; the confirmation
  runs the memory arm and the iso-FLOP dense model at their rates, one run per seed and corpus; every run with memory
  is knocked out once; a second invocation trains nothing."""
  trained, evaluated, _ = faked
  out = str(tmp_path)
  text = capacity.run(out, SPEC, True, 1)
  arms = ["routed-prefix-attention", "dense-mlp624"]
  rounds = (("0.005", "0.00167"), ("0.015",))
  assert trained == GATE_RUNS + [f"{a}-base_lr{r}-memory_lr{r}-steps4" for rates in rounds for a in arms
                                 for r in rates] + [
      f"{a}-base_lr0.005-memory_lr0.005" for a in arms] + [
      f"{a}-base_lr0.005-memory_lr0.005-corpus{s + 1}-seed{s}" for s in (0, 1) for a in arms]
  assert evaluated == [n for n in trained if n.startswith("routed")]
  assert "| dense-mlp624 | 0.00167, 0.005, 0.015 | 0.005 | bracketed |" in text
  assert "## The goal\n\nnot counted: the gate did not pass" not in text  # the faked gate passes
  assert ("**met**. routed-prefix-attention recalls 0.655 ± 0.005 against the iso-FLOP dense model's 0.605 ± 0.005 "
          "(dense-mlp624; mean ± standard error over 2 seeds and corpora): Welch's t +7.07") in text
  count = len(trained)
  capacity.run(out, SPEC, True, 1)
  assert len(trained) == count  # nothing trained twice


def _arm_run(arm, recall, *, memory=True, tree_read=False, flops=100, val_ce=1.7):
  return {"status": "done", "arm": arm, "recall": recall, "val_ce": val_ce, "memory": memory, "tree_read": tree_read,
          "flops_per_token": flops}


def test_the_confirmation_takes_the_best_memory_of_each_addressing():
  """The memory arm with the best recall (here one read by the cluster tree), then the best of those read by their
  own router (a tie in recall goes to the lower validation CE); the dense arm nearest the first in FLOPs per token is
  their iso-FLOP model. One addressing alone: its best arm only; no dense arm: nothing."""
  runs = [_arm_run("subject", 0.407, tree_read=True, flops=105), _arm_run("cluster", 0.311, tree_read=True),
          _arm_run("pkm", 0.389, flops=110, val_ce=1.70), _arm_run("moc", 0.389, flops=108, val_ce=1.69),
          _arm_run("hml", 0.357), _arm_run("iso", 0.361, memory=False, flops=104),
          _arm_run("narrow", 0.361, memory=False, flops=40), {"status": "failed", "arm": "ffn"}]
  memories, dense = capacity.choose_confirmed(runs)
  assert [r["arm"] for r in memories] == ["subject", "moc"] and dense["arm"] == "iso"
  routed, dense = capacity.choose_confirmed([r for r in runs if not r.get("tree_read")])
  assert [r["arm"] for r in routed] == ["moc"] and dense["arm"] == "iso"
  assert capacity.choose_confirmed([r for r in runs if r.get("memory")]) is None


def test_the_confirmation_judges_the_best_arm_first_then_the_other_addressing(tmp_path, faked, monkeypatch):
  """With a memory arm read by the cluster tree among the arms: the confirmation starts the best arm's runs (the first
  of equals: MoC, read by its router) and the dense model's on every seed first, then the best tree-read arm's; the
  report judges the goal for each, the best arm first."""
  trained, _, _ = faked
  monkeypatch.setitem(capacity.SIZES, "quick", {**QUICK, "memory_arms": 4})
  out = str(tmp_path)
  capacity.run(out, SPEC, True, 1, stages=["preflight", "gate", "arms"])
  del trained[:]
  text = capacity.run(out, SPEC, True, 1, stages=["confirm"])
  cluster = "k16-levels2-cluster-mean-cluster_chapters0_1"
  seeds = [f"base_lr0.005-memory_lr0.005-corpus{s + 1}-seed{s}" for s in (0, 1)]
  assert trained == [f"{arm}-{seed}" for seed in seeds for arm in ("routed-prefix-attention", "dense-mlp624")] + [
      f"{cluster}-{seed}" for seed in seeds]
  goals = text.split("## The goal")[1]
  assert goals.index("**met**. routed-prefix-attention recalls") < goals.index(f"**met**. {cluster} recalls")


def test_confirm_needs_every_arm(tmp_path, faked):
  with pytest.raises(UsageError, match="stage confirm needs every arm of stage arms finished .0 of 2"):
    capacity.run(str(tmp_path), SPEC, True, 1, stages=["confirm"])


@pytest.mark.slow
def test_quick_end_to_end(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.capacity", "--quick", f"--out={tmp_path}",
                         "--parallel=1"], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (tmp_path / "capacity.md").read_text()
  assert "## The gate" in text and "## The goal" in text and "## Wall time" in text


def test_a_cluster_arms_recall_on_its_entitys_path_is_read_from_its_evaluation(tmp_path, faked, monkeypatch):
  """Each memory run's eval.json here also holds moc_jax.eval's entity_paths (recall 0.41; 0.34 and 0.27 of the
  prompts on their entity's node at the two levels; 0.38 from the path alone): the table shows the recall, the last
  level's share and the path's recall, and the dense runs, which have none, leave the cell empty."""
  real = capacity.evaluate_runs  # the faked one

  def with_entity_paths(runs, parallel, harness):
    real(runs, parallel, harness)
    for workdir, memory in runs:
      with open(os.path.join(workdir, "eval.json")) as f:
        report = json.load(f)
      report["entity_paths"] = {"agreement": [0.34, 0.27], "fact_recall": {"probe_acc": 0.41}, "path_alone": 0.38}
      with open(os.path.join(workdir, "eval.json"), "w") as f:
        json.dump(report, f)
  monkeypatch.setattr(capacity, "evaluate_runs", with_entity_paths)
  text = capacity.run(str(tmp_path), SPEC, True, 1, stages=["preflight", "gate", "arms"])
  memory_rows = [line for line in text.splitlines() if line.startswith("| routed-prefix-attention-base_lr")]
  dense_rows = [line for line in text.splitlines() if line.startswith("| dense-mlp624-base_lr")]
  assert memory_rows and all("| 0.300 | 0.410 (0.27; path alone 0.380) |" in line for line in memory_rows)
  assert dense_rows and all("| | 0.410" not in line and "(0.27)" not in line for line in dense_rows)
