"""Cross-entropy and perplexity over a fixed list of batches: the one CE evaluator of training (the
validation curve) and of `python -m moc_jax.eval` (any split, optionally with the routing decisions)."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from moc_jax import data as data_lib
from moc_jax.eval.scoring import everywhere
from moc_jax.losses import forward, next_token_nll
from moc_jax.state import eval_data_config


def split_batches(config, split: str, paths: str = "document") -> list[dict]:
  """The split's global eval batches (the training evaluation's rows, `train.eval_batches` of them); `paths`: the
  cluster paths' mode (data/cluster_paths.py) when the batches carry them."""
  return list(data_lib.make_eval_batches(eval_data_config(config), split=split,
                                         max_batches=config.train.eval_batches, paths=paths))


# per memory layer and batch, averaged by eval.routing.Usage (pool_share: with memory.routing_pool=attention)
ROUTING_STATS = ("shared_mass", "routed_entropy", "pool_share")


class CEEvaluator:
  """CE and perplexity over `batches`, one jitted forward per batch. With `routing=True` the step also
  returns the routing decisions (aux `chapters`, or a product-key memory's `slots`) and the routers' per-layer
  `ROUTING_STATS` for the call's `on_routing`; without, it computes CE alone (the training loop's evaluation)."""

  def __init__(self, graphdef, p_shard, batch_sharding, batches, routing=False):
    self.batches, self.sharding, self.routing = batches, batch_sharding, routing

    def step(params, batch):
      logits, aux = forward(nnx.merge(graphdef, params), batch, train=False)
      nll, count = next_token_nll(logits, batch["labels"])
      if not routing:
        return nll, count
      if "chapters" not in aux and "slots" not in aux:
        return nll, count, None
      return nll, count, {k: everywhere(aux[k]) for k in ("chapters", "slots", *ROUTING_STATS) if k in aux}

    self.step = jax.jit(step, in_shardings=(p_shard, batch_sharding))

  def __call__(self, params, on_routing=None, batches=None) -> dict:
    """`batches`: others of the same shapes (the same split with prefix cluster paths) in place of the evaluator's
    own, through the same compiled step."""
    nll, count = 0.0, 0
    for b in self.batches if batches is None else batches:
      b = {k: v for k, v in b.items() if k != "n_malformed"}
      # every process holds the whole global batch and hands each of its devices that device's rows
      out = self.step(params, {k: jax.make_array_from_callback(v.shape, self.sharding, lambda i, v=v: v[i])
                               for k, v in b.items()})
      nll, count = nll + float(out[0]), count + int(out[1])
      if on_routing is not None and self.routing and out[2] is not None:
        on_routing(jax.tree.map(np.asarray, out[2]), b["attention_mask"])
    ce = nll / max(count, 1)
    return {"ce": ce, "ppl": float(np.exp(min(ce, 50.0))), "tokens": count}
