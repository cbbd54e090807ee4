"""One tiny model on one device with its split evaluator and usage counts over two fixed batches: what the routing
analysis tests of every memory kind evaluate; and a saved run for `python -m moc_jax.eval` to restore."""
import jax
import numpy as np
from flax import nnx

import moc_jax
from moc_jax import causality, sharding
from moc_jax import state as state_lib
from moc_jax.checkpoint import Checkpointer
from moc_jax.eval import routing as ra
from moc_jax.eval.ce import CEEvaluator


def batches(vocab, seed=0):
  """Two [4, 32] batches: full rows, right padding, a 5-token row and one all-padding row."""
  rng = np.random.default_rng(seed)
  out = []
  for lengths in ((32, 20, 5, 32), (31, 32, 9, 0)):
    ids = rng.integers(0, 256, (4, 32)).astype(np.int32)
    mask = (np.arange(32)[None] < np.array(lengths)[:, None]).astype(np.int32)
    ids = np.where(mask > 0, ids, 256)  # the byte tokenizer's pad id
    out.append({"input_ids": ids, "attention_mask": mask, "labels": np.where(mask > 0, ids, -100).astype(np.int32)})
  return out


class EvalSetup:
  """`configs/moc.py:tiny` in float32 on 32-token rows of 4 with `overrides`, on one device; `prepare(model)` draws
  whatever weights start at zero so the memory reaches the loss. `base` is the split's CE with usage counted."""

  def __init__(self, overrides, prepare):
    self.config = moc_jax.load_config("configs/moc.py:tiny", {
        "model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 4,
        **overrides})
    self.mesh = sharding.make_mesh(self.config, jax.devices()[:1])
    with sharding.activate(self.mesh, sharding.rules_of(self.config)):
      layout = state_lib.build_state(self.config, self.mesh)
      model = moc_jax.build_model(self.config, seed=0)
      prepare(model)
      self.graphdef = layout.graphdef
      self.params = jax.device_put(nnx.state(model, nnx.Param), layout.shardings["params"])
      self.batches = batches(self.config.model.vocab_size)
      self.evaluator = CEEvaluator(layout.graphdef, layout.shardings["params"],
                                   sharding.data_sharding(self.config, self.mesh), self.batches, routing=True)
      self.usage = ra.Usage(self.config)
      self.base = self.evaluator(self.params, self.usage.add)

  def ce(self, params):
    with sharding.activate(self.mesh, sharding.rules_of(self.config)):
      return self.evaluator(params)["ce"]


def save_run(config, workdir, step=2):
  """`config`'s initial state, its zero-initialised weights re-drawn (so the memory reaches the loss), saved in
  `workdir` at `step` with its config.json, as training leaves them -> (layout, the saved parameters)."""
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    model = nnx.merge(layout.graphdef, state["params"])
    causality._redraw_zeros(model, seed=1)
    state["params"] = jax.device_put(nnx.state(model, nnx.Param), layout.shardings["params"])
    checkpointer = Checkpointer(str(workdir / "checkpoints"), padding=layout.padding)
    checkpointer.save(step, state)
    checkpointer.close()
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  return layout, state["params"]

