"""The evaluation the training loop runs every `train.eval_every` steps: validation CE and, on moc_facts,
fact recall on a fixed sample of probes. Handed to the loop from outside (`train_and_evaluate(...,
make_evaluator=ValidationEvaluator)`), so training does not depend on evaluation code."""
from __future__ import annotations

from moc_jax import data as data_lib
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax.eval.ce import CEEvaluator, split_batches
from moc_jax.eval.probes import ProbeEvaluator, select_probes


class ValidationEvaluator:
  """Validation CE over the eval split (and fact recall on moc_facts probes)."""

  def __init__(self, config, graphdef, p_shard, batch_sharding):
    self.ce = CEEvaluator(graphdef, p_shard, batch_sharding, split_batches(config, "validation"))
    self.probes = None
    if config.data.name == "moc_facts":
      probes = select_probes(data_lib.load_probes(config.data), config.train.num_probes, config.seed)
      self.probes = ProbeEvaluator(graphdef, probes, model_tokenizer(config))

  def __call__(self, params) -> dict:
    out = self.ce(params)
    if self.probes is not None:
      out.update(self.probes(params))
    return out
