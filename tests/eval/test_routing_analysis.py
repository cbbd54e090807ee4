"""Routing analysis in every routing mode: usage counts against a loop over the model's own decisions,
ablation (unused chapters change nothing, exactly; used ones change the loss), statistics, stability
prompts, plots and bad --ablate_chapters specs."""
import math

import numpy as np
import pytest

import moc_jax
from moc_jax import causality, sharding
from moc_jax.errors import ConfigError
from moc_jax.eval import routing as ra
from tests.eval.eval_utils import EvalSetup

MODES = ("sequence", "token", pytest.param("prefix", marks=pytest.mark.slow), "chunk")  # prefix decides as token
CHUNK = 8


class Setup(EvalSetup):
  """A tiny model (float32, zero-initialised weights re-drawn so the memory reaches the loss) under one
  routing mode, on one device, with its split evaluator and usage over two fixed batches."""

  def __init__(self, routing):
    super().__init__({"memory.routing": routing, "memory.routing_chunk": CHUNK},
                     lambda model: causality._redraw_zeros(model, seed=1))
    self.router = ra.Router(self.graphdef)

  def route(self, ids, mask):
    with sharding.activate(self.mesh, sharding.rules_of(self.config)):
      return self.router(self.params, ids, mask)


@pytest.fixture(scope="module", params=MODES)
def setup(request):
  return Setup(request.param)


def _hand_counts(setup):
  """Routed selections per (layer, chapter), counted in a loop over every decision of every batch."""
  cfg = setup.config
  counts = np.zeros((2, cfg.memory.num_chapters), np.int64)
  decisions = 0
  for b in setup.batches:
    chapters = setup.route(b["input_ids"], b["attention_mask"])
    mask = b["attention_mask"]
    for row in range(mask.shape[0]):
      if cfg.memory.routing == "sequence":
        seen = [(None, mask[row].any())]
      elif cfg.memory.routing == "chunk":
        seen = [(d, mask[row, d * CHUNK:(d + 1) * CHUNK].any()) for d in range(chapters.shape[2])]
      else:
        seen = [(t, mask[row, t] == 1) for t in range(mask.shape[1])]
      for d, real in seen:
        if not real:
          continue
        decisions += 1
        for layer in range(2):
          slots = chapters[layer, row] if d is None else chapters[layer, row, d]
          for c in (slots if cfg.memory.routing == "token" else slots[cfg.memory.num_shared:]):
            counts[layer, c] += 1
  return counts, decisions


def test_usage_counts_equal_a_count_over_the_models_decisions(setup):
  counts, decisions = _hand_counts(setup)
  np.testing.assert_array_equal(setup.usage.counts, counts)
  assert setup.usage.decisions == decisions
  per_position = 32 + 20 + 5 + 32 + 31 + 32 + 9
  expected = {"sequence": 7, "chunk": 4 + 3 + 1 + 4 + 4 + 4 + 2, "token": per_position, "prefix": per_position}
  assert decisions == expected[setup.config.memory.routing]
  for row in setup.usage.stats():
    assert row["routed_selections"] == decisions * setup.config.memory.top_k


def test_ablating_unused_chapters_changes_nothing_and_used_ones_change_the_loss(setup):
  used = setup.usage.counts.sum(axis=0) > 0
  unused = np.flatnonzero(~used)
  unused = unused[unused >= setup.config.memory.num_shared]
  assert len(unused) > 5, "the fixture should leave chapters unselected"
  base = setup.base["ce"]
  assert setup.ce(setup.params) == base
  assert setup.ce(ra.zero_chapters(setup.params, ra.ablation_mask(("ids", unused.tolist()), setup.usage))) == base
  top = ra.ablation_mask(("top", 3), setup.usage)
  assert top.sum() == 3 and not top[0, :setup.config.memory.num_shared].any() and used[top[0]].all()
  changed = setup.ce(ra.zero_chapters(setup.params, top))
  assert changed != base and math.isfinite(changed)
  routed = ra.ablation_mask(("routed", None), setup.usage)
  assert routed[:, setup.config.memory.num_shared:].all() and not routed[:, :setup.config.memory.num_shared].any()
  assert setup.ce(ra.zero_chapters(setup.params, routed)) not in (base, changed)


def test_zeroing_keeps_the_device_layout_and_zeroes_only_the_named_chapters(setup):
  mask = ra.ablation_mask(("ids", [0, 5, 64]), setup.usage)
  before = np.asarray(setup.params["bank"]["memory"][...])
  after = ra.zero_chapters(setup.params, mask)["bank"]["memory"][...]
  assert after.sharding == setup.params["bank"]["memory"][...].sharding
  after = np.asarray(after)
  assert not after[:, [0, 5, 64]].any()
  keep = np.setdiff1d(np.arange(65), [0, 5, 64])
  np.testing.assert_array_equal(after[:, keep], before[:, keep])


def test_answer_decision_is_the_last_prompt_positions_own(setup):
  """In the causal modes a position's decision ignores what follows it: the decision read from padded
  prompts equals the one at the prompt's last position (chunk: its chunk) with other tokens after it."""
  cfg = setup.config
  if cfg.memory.routing == "sequence":
    pytest.skip("sequence routing pools the padding: one decision per row")
  lengths, at = (5, 19, 32, 9), {"chunk": (0, 2, 3, 1)}.get(cfg.memory.routing, (4, 18, 31, 8))
  tokens = np.random.default_rng(3).integers(0, 256, (4, 32)).astype(np.int32)
  mask = (np.arange(32)[None] < np.array(lengths)[:, None]).astype(np.int32)
  got = ra.answer_decision(setup.route(np.where(mask > 0, tokens, 256), mask), mask, cfg.memory.routing, CHUNK,
                           cfg.memory.num_shared)
  longer = setup.route(tokens, np.ones_like(mask))
  for row, d in enumerate(at):
    want = longer[:, row, d]
    np.testing.assert_array_equal(got[:, row], want if cfg.memory.routing == "token" else want[:, 1:])


def test_usage_statistics_by_hand():
  cfg = moc_jax.load_config("configs/moc.py:tiny", {"memory.num_chapters": 5, "memory.num_tokens": 80,
                                                    "memory.top_k": 2})
  usage = ra.Usage(cfg)
  usage.counts[:] = [[9, 4, 4, 0, 0], [0, 1, 1, 1, 1]]  # the shared chapter 0 is not counted
  usage.decisions = 4
  a, b = usage.stats()
  assert (a["layer"], a["routed_selections"], a["chapters_selected"], a["chapters_selected_frac"]) == (1, 8, 2, 0.5)
  assert a["usage_entropy"] == pytest.approx(math.log(2)) and a["effective_chapters"] == pytest.approx(2)
  assert b["usage_entropy"] == pytest.approx(math.log(4)) == pytest.approx(b["usage_entropy_max"])
  assert a["top_chapters"] == [[1, 4], [2, 4]]
  assert (a["max_load"], b["max_load"]) == (2.0, 1.0)  # most used routable chapter over the routable mean
  assert ra.ablation_mask(("top", 3), usage).tolist() == [[False, True, True, True, False]]
  assert ra.ablation_mask(("routed", None), usage).tolist() == [[False, True, True, True, True]]  # unused ones too


def test_decision_masks_and_jaccard_by_hand():
  mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
  assert ra.decision_mask(mask, "sequence", 2).tolist() == [True, False]
  assert ra.decision_mask(mask, "prefix", 2).tolist() == mask.astype(bool).tolist()
  assert ra.decision_mask(mask, "chunk", 2).tolist() == [[True, True, False], [False, False, False]]
  np.testing.assert_allclose(ra.jaccard(np.array([[1, 2, 3], [4, 5, 6]]), np.array([[3, 2, 1], [6, 7, 8]])),
                             [1.0, 0.2])


def test_stability_prompts_use_another_template_and_another_entity():
  probes = [{"prompt": "Ana Bel was born in", "entity": "Ana Bel", "attribute": "birth_city"},
            {"prompt": "The birth year of Cy Dun is", "entity": "Cy Dun", "attribute": "birth_year"}]
  assert ra.stability_prompts(probes) == [
      ("Ana Bel was born in", "The birthplace of Ana Bel is", "Cy Dun was born in"),
      ("The birth year of Cy Dun is", "Cy Dun came into the world in", "The birth year of Ana Bel is")]
  assert ra.stability_prompts(probes[:1])[0][2] is None


@pytest.mark.parametrize("spec, match", [("top:0", "positive integer"), ("top:x", "positive integer"),
                                         ("3,65", "in range"), ("a,b", "in range"), ("", "in range")])
def test_bad_ablation_specs_name_the_fix(spec, match):
  cfg = moc_jax.load_config("configs/moc.py:tiny")
  with pytest.raises(ConfigError, match=f"--ablate_chapters.*{match}.*top:N or routed"):
    ra.parse_ablation(spec, cfg)
  assert ra.parse_ablation("3, 17", cfg) == ("ids", [3, 17]) and ra.parse_ablation("top:4", cfg) == ("top", 4)
  assert ra.parse_ablation(" routed", cfg) == ("routed", None)
  with pytest.raises(ConfigError, match="no memory bank"):
    ra.parse_ablation("1", moc_jax.load_config("configs/vanilla.py:tiny"))


def test_plots_are_written(tmp_path):
  cfg = moc_jax.load_config("configs/moc.py:tiny")
  usage = ra.Usage(cfg)
  usage.counts[:] = np.random.default_rng(0).poisson(3, usage.counts.shape)
  usage.decisions = 10
  ra.plot(usage, str(tmp_path / "h.png"), str(tmp_path / "u.png"))
  for name in ("h.png", "u.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
