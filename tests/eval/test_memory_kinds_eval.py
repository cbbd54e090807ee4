"""Memory health of the product-key kinds (memory.kind pkm, hml) in `moc_jax.eval`'s routing analysis: slot usage
against a loop over the model's own lookups, the knock-out of the value table (`--ablate_chapters=routed`: every
slot) and of unused slots (nothing changes, exactly), the slot ids an ablation accepts, and the summary table."""
import math

import jax
import numpy as np
import pytest
from flax import nnx

from moc_jax.errors import ConfigError
from moc_jax.eval import routing as ra
from moc_jax.eval.run import markdown_table
from tests.eval.eval_utils import EvalSetup


def _draw_values(model):
  """hml's value table starts at zero (an inserted block is the identity): draw it so the table reaches the loss."""
  model.bank.memory.set_value(jax.random.normal(jax.random.key(1), model.bank.memory[...].shape))


class Setup(EvalSetup):
  """A tiny `kind` model (float32, 32 x 32 slots, top-2; pkm's W2 drawn, hml's values drawn, so the memory reaches the
  loss) on one device, with its split evaluator and slot usage over two fixed batches."""

  def __init__(self, kind):
    super().__init__({"memory.kind": kind, "memory.pkm_sub_keys": 32, "memory.pkm_top_k": 2, "memory.pkm_key_dim": 16,
                      "memory.wo_init_zero": False}, _draw_values if kind == "hml" else lambda model: None)
    self.lookups = jax.jit(lambda p, ids, mask: nnx.merge(self.graphdef, p)(ids, mask)[1]["slots"])


@pytest.fixture(scope="module", params=["pkm", "hml"])
def setup(request):
  return Setup(request.param)


def test_slot_usage_counts_every_head_and_real_position(setup):
  counts, positions = np.zeros((2, 1024), np.int64), 0
  for b in setup.batches:
    slots = np.asarray(setup.lookups(setup.params, b["input_ids"], b["attention_mask"]))  # [2, B, L, H, k]
    for row, t in zip(*np.nonzero(b["attention_mask"])):
      positions += 1
      for layer in range(2):
        np.add.at(counts[layer], slots[layer, row, t].reshape(-1), 1)
  np.testing.assert_array_equal(setup.usage.counts, counts)
  assert setup.usage.decisions == positions == 32 + 20 + 5 + 32 + 31 + 32 + 9
  heads = 4  # pkm_heads and tiny's attention heads alike
  for layer, row in zip(range(2), setup.usage.stats()):
    assert row["routed_selections"] == positions * heads * 2
    assert row["slots_selected"] == int((counts[layer] > 0).sum())
    assert row["slots_selected_frac"] == pytest.approx((counts[layer] > 0).mean())
    assert row["max_load"] == pytest.approx(counts[layer].max() / counts[layer].mean())
    assert "chapters_selected" not in row


def test_knock_outs_of_the_table(setup):
  base = setup.base["ce"]
  unused = np.flatnonzero(setup.usage.counts.sum(axis=0) == 0)
  assert len(unused) >= 1, "the fixture should leave slots unread"
  assert setup.ce(ra.zero_chapters(setup.params, ra.ablation_mask(("ids", unused.tolist()), setup.usage))) == base
  every = ra.ablation_mask(ra.parse_ablation("routed", setup.config), setup.usage)
  assert every.all() and every.shape == (1, 1024)  # no slot is always read: `routed` is the whole table
  zeroed = ra.zero_chapters(setup.params, every)
  assert not np.asarray(zeroed["bank"]["memory"][...]).any()
  knocked = setup.ce(zeroed)
  assert knocked != base and math.isfinite(knocked)


def test_slot_ids_of_an_ablation_are_checked_against_the_table(setup):
  assert ra.parse_ablation("1023", setup.config) == ("ids", [1023])
  with pytest.raises(ConfigError, match=r"not a list of slot ids in range — use comma-separated slot ids in \[0, 1024\)"):
    ra.parse_ablation("1024", setup.config)


def test_summary_reports_slots(setup):
  report = {"workdir": "w", "step": 1, "config": "c", "devices": 1, "split": "validation", "ce": 1.0, "ppl": 2.7,
            "tokens": 10, "files": {},
            "routing": {"kind": setup.config.memory.kind, "routing": "product keys", "layers": setup.usage.stats()},
            "ablation": {"spec": "routed", "unit": "slots", "chapters": {"0": list(range(1024))}, "ce": 1.5,
                         "ce_delta": 0.5}}
  text = markdown_table(report)
  assert "| memory layer | slots ever read |" in text and "(1024 slots zeroed)" in text
