"""The numpy MoC-PT oracle must reproduce MoC-PT's own fp32 outputs before it may judge the port."""
import json
import os

import numpy as np
import pytest

from tests.convert.mocpt_numpy import mocpt_forward


def _find(name):
  return next((p for p in (os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", name),
                           os.path.join("/work/shared/fixtures", name)) if os.path.exists(p)), "")


FIXTURE = _find("moc_pt_paper_small.npz")  # sequence routing
TOKEN_FIXTURE = _find("moc_pt_token_small.npz")  # token routing, right-padded batch

needs_fixture = pytest.mark.skipif(not os.path.exists(FIXTURE), reason="MoC-PT fixture not available")
needs_token_fixture = pytest.mark.skipif(not os.path.exists(TOKEN_FIXTURE),
                                         reason="MoC-PT token-routing fixture not available")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _load(path):
  data = np.load(path)
  meta = json.loads(str(data["meta_json"]))
  state = {k[len("param/"):]: data[k] for k in data.files if k.startswith("param/")}
  return data, meta, state


@pytest.fixture(scope="module")
def fixture():
  return _load(FIXTURE)


@pytest.fixture(scope="module")
def token_fixture():
  return _load(TOKEN_FIXTURE)


@needs_fixture
def test_reference_reproduces_mocpt_fixture(fixture):
  data, meta, state = fixture
  logits, ce, aux, info = mocpt_forward(meta["model"], meta["memory"], state, data["input_ids"],
                                        data["attention_mask"], train=True, labels=data["labels"],
                                        return_info=True)
  assert _rel(logits, data["logits"]) <= 1e-6
  assert _rel(ce, data["eval_loss"]) <= 1e-6
  assert _rel(ce + aux, data["train_loss"]) <= 1e-6
  # the fixture really exercises per-sequence routing (otherwise the check above proves less)
  assert all(len({tuple(row) for row in ids}) > 1 for ids in info["ids"])


@needs_fixture
def test_reference_eval_has_no_aux(fixture):
  data, meta, state = fixture
  _, ce, aux = mocpt_forward(meta["model"], meta["memory"], state, data["input_ids"],
                             data["attention_mask"], train=False, labels=data["labels"])
  assert aux == 0.0
  assert _rel(ce, data["eval_loss"]) <= 1e-6


def _without_memory_output(state):
  """The state with every memory o_proj zeroed: the memory no longer reaches the logits."""
  return {k: np.zeros_like(v) if k.endswith("memory_attn.o_proj.weight") else v for k, v in state.items()}


@needs_fixture
def test_reference_sees_the_memory_path(fixture):
  """Zeroing memory o_proj must move the logits well above the 1e-6 bar, or the check is blind to memory."""
  data, meta, state = fixture
  logits, _, _ = mocpt_forward(meta["model"], meta["memory"], _without_memory_output(state), data["input_ids"],
                               data["attention_mask"], labels=data["labels"])
  assert _rel(logits, data["logits"]) > 1e-4


@needs_token_fixture
def test_reference_reproduces_mocpt_token_fixture(token_fixture):
  data, meta, state = token_fixture
  assert meta["memory"]["routing_strategy_train"] == meta["memory"]["routing_strategy_inference"] == "token"
  logits, ce, aux, info = mocpt_forward(meta["model"], meta["memory"], state, data["input_ids"],
                                        data["attention_mask"], train=True, labels=data["labels"],
                                        return_info=True)
  assert info["strategy"] == "token"
  assert _rel(logits, data["logits"]) <= 1e-6
  assert _rel(ce, data["eval_loss"]) <= 1e-6
  assert _rel(ce + aux, data["train_loss"]) <= 1e-6
  eval_logits, eval_ce, eval_aux = mocpt_forward(meta["model"], meta["memory"], state, data["input_ids"],
                                                 data["attention_mask"], train=False, labels=data["labels"])
  assert eval_aux == 0.0
  assert _rel(eval_logits, data["logits"]) <= 1e-6
  assert _rel(eval_ce, data["eval_loss"]) <= 1e-6
  # the batch is right-padded (pads read memory and count as router samples in MoC-PT)
  assert np.any(data["attention_mask"] == 0)
  # the routing really varies across positions, within every sequence, in every memory layer
  for ids in info["ids"]:
    assert ids.shape == data["input_ids"].shape + (meta["memory"]["top_k_chapters"],)
    assert all(len({tuple(sorted(r)) for r in row}) > 1 for row in ids)
  # and the chapters (and their order) are the ones MoC-PT itself chose
  checked = meta.get("routing_check") or {}
  for layer, ids in zip(info["layers"], info["ids"]):
    if str(layer) in checked:
      np.testing.assert_array_equal(ids, np.asarray(checked[str(layer)]["chapter_ids"]))


@needs_token_fixture
def test_reference_sees_the_token_routed_branches(token_fixture):
  """Dropping memory, or only its routed branch, must move the logits well above the 1e-6 bar."""
  data, meta, state = token_fixture
  ablated = _without_memory_output(state)
  no_routed = dict(meta["memory"], routed_scaling_factor=0.0)
  for memory_cfg, st in ((meta["memory"], ablated), (no_routed, state)):
    logits, _, _ = mocpt_forward(meta["model"], memory_cfg, st, data["input_ids"], data["attention_mask"],
                                 labels=data["labels"])
    assert _rel(logits, data["logits"]) > 1e-4
