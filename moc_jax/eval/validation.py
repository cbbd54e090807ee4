"""The evaluation the training loop runs every `train.eval_every` steps: validation CE and, on moc_facts,
fact recall on a fixed sample of probes. Handed to the loop from outside (`train_and_evaluate(...,
make_evaluator=ValidationEvaluator)`), so training does not depend on evaluation code.

Under `memory.routing=cluster` the CE reads by each validation document's whole path, as training does, which tells
a position something of the tokens after it; `ce_prefix_path` is the same CE with each token's path from its
document up to it (causal), and probes read by their prompt's path alone."""
from __future__ import annotations

from moc_jax import data as data_lib
from moc_jax.config import reads_cluster_paths
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax.eval.ce import CEEvaluator, split_batches
from moc_jax.eval.probes import ProbeEvaluator, select_probes, with_prompt_paths


class ValidationEvaluator:
  """Validation CE over the eval split (and fact recall on moc_facts probes)."""

  def __init__(self, config, graphdef, p_shard, batch_sharding):
    self.ce = CEEvaluator(graphdef, p_shard, batch_sharding, split_batches(config, "validation"))
    self.prefix_batches = split_batches(config, "validation", paths="prefix") if reads_cluster_paths(config) else None
    self.probes = None
    if config.data.name == "moc_facts":
      tokenizer = model_tokenizer(config)
      probes = select_probes(data_lib.load_probes(config.data), config.train.num_probes, config.seed)
      self.probes = ProbeEvaluator(graphdef, with_prompt_paths(config, probes, tokenizer), tokenizer)

  def __call__(self, params) -> dict:
    out = self.ce(params)
    if self.prefix_batches is not None:
      out["ce_prefix_path"] = self.ce(params, batches=self.prefix_batches)["ce"]
    if self.probes is not None:
      out.update(self.probes(params))
    return out
