"""Where attention-pooled routing looks (`memory.routing_pool=attention`): for a run's fact prompts, per memory
layer, the share of the answer's routing decision's pooling weight that falls on the entity's name, against the
share the plain mean would give it, and the tokens weighed most.

A router keyed on the entity routes a fact and its paraphrase alike and lets chapters specialise by entity; one
keyed on the template's words does not (docs/routing.md#routing-on-what-the-text-is-about-attention-pooling-routing_poolattention).

  python -m moc_jax.eval.pool_focus WORKDIR [WORKDIR ...] [--probes=64] [--json]

The answer's decision is the one that predicts the token after the prompt: under `prefix` and `sequence` /
`segment` it pools every prompt position, under `chunk` those before the last position's chunk. The prompts are a
fixed sample of the seen facts (`probes.select_probes` with the run's seed, as the evaluation draws its own). Only
the workdirs are read.
"""
import argparse
import collections
import json
import sys

import jax
import numpy as np
from flax import nnx

from moc_jax import cli, data as data_lib, sharding
from moc_jax.config import memory_layers
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax.errors import ConfigError
from moc_jax.eval.probes import select_probes
from moc_jax.eval.scoring import pad_rows
from moc_jax.state import build_state, restore_params


def entity_span(tokenizer, prompt: str, entity: str) -> tuple[int, int]:
  """Token positions [start, end) of the first occurrence of `entity` in `prompt` (by the token counts of the text
  before and through it)."""
  at = prompt.index(entity)
  return len(tokenizer.encode(prompt[:at])), len(tokenizer.encode(prompt[:at + len(entity)]))


def decision_positions(length: int, routing: str, chunk: int) -> np.ndarray:
  """[length] bool: the prompt positions the answer's decision pools (chunk: those before the last one's chunk)."""
  t = np.arange(length)
  return t < (length - 1) // chunk * chunk if routing == "chunk" else np.ones(length, bool)


def focus(weights, lengths, spans, routing: str, chunk: int) -> list[dict]:
  """weights [n_mem, N, W] pooling weights of N right-padded prompts of `lengths`, with the entity at token `spans`
  -> per memory layer {entity_share, uniform_share, top_positions}: the answer decision's mean share of weight on the
  entity's tokens, the same for equal weights, and per prompt the position it weighs most (None for a prompt whose
  decision pools nothing: a `chunk` prompt shorter than one chunk, left out of the shares)."""
  out = []
  for w in np.asarray(weights, np.float64):
    shares, uniform, top = [], [], []
    for row, n, (a, b) in zip(w, lengths, spans):
      seen = decision_positions(n, routing, chunk)
      if not seen.any():
        top.append(None)
        continue
      on = seen.copy()
      on[:a], on[b:] = False, False
      shares.append(row[:n][on].sum() / row[:n][seen].sum())
      uniform.append(on.sum() / seen.sum())
      top.append(int(np.argmax(np.where(seen, row[:n], -np.inf))))
    out.append({"entity_share": float(np.mean(shares)) if shares else None,
                "uniform_share": float(np.mean(uniform)) if uniform else None, "top_positions": top})
  return out


def pool_focus(workdir: str, num_probes: int = 64) -> list[dict]:
  """Per memory layer: {layer, probes, entity_share, uniform_share, top_tokens [[token, count], ...]}; a ConfigError
  names the fix for a run that is not attention-pooled or not trained on moc_facts."""
  config = cli.run_config(workdir, {})
  if not memory_layers(config) or config.memory.routing_pool != "attention":
    raise ConfigError(f"{workdir}: memory.routing_pool is not attention (every position weighs alike); give a run "
                      "trained with --config.memory.routing_pool=attention")
  if config.data.name != "moc_facts":
    raise ConfigError(f"{workdir}: config.data.name is {config.data.name!r}; pool_focus reads moc_facts prompts")
  tokenizer = model_tokenizer(config)
  probes = select_probes(data_lib.load_probes(config.data), num_probes, config.seed)
  rows = [tokenizer.encode(p["prompt"]) for p in probes]
  spans = [entity_span(tokenizer, p["prompt"], p["entity"]) for p in probes]
  ids, mask = pad_rows(rows, tokenizer.pad_id)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    params, _ = restore_params(workdir, layout, None)
    graphdef = layout.graphdef
    weights = jax.jit(lambda p, i, m: nnx.merge(graphdef, p).features(i, m)[1]["pool_weights"])(params, ids, mask)
  mem = config.memory
  layers = focus(jax.device_get(weights), [len(r) for r in rows], spans, mem.routing, mem.routing_chunk)
  for layer, row in zip(memory_layers(config), layers):
    tops = collections.Counter(tokenizer.decode([rows[i][t]]) for i, t in enumerate(row.pop("top_positions"))
                               if t is not None)
    row.update(layer=layer, probes=len(probes), top_tokens=[[k, v] for k, v in tops.most_common(5)])
  return layers


@cli.exit_on_error
def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--probes", type=int, default=64, help="fact prompts to read (a fixed sample of the seen facts)")
  parser.add_argument("--json", action="store_true", help="one JSON object per line")
  args = parser.parse_args(argv)
  if args.probes < 1:
    raise ConfigError(f"--probes={args.probes}: must be >= 1")
  for workdir in args.workdirs:
    for row in pool_focus(workdir, args.probes):
      if args.json:
        print(json.dumps({"workdir": workdir, **row}))
      else:
        tops = ", ".join(f"{k!r} {v}" for k, v in row["top_tokens"])
        print(f"{workdir}  layer {row['layer']}: {row['entity_share']:.3f} of the answer decision's pooling weight "
              f"on the entity (equal weights: {row['uniform_share']:.3f}); most weighed: {tops}")


if __name__ == "__main__":
  sys.exit(main())
