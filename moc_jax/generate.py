"""Text generation from a run's checkpoint:

  python -m moc_jax.generate --workdir=DIR --prompt "..." [--max_new_tokens N] [--temperature T --top_p P
      --seed S] [--step N] [--routing MODE] [--config.a.b=v ...]

Rebuilds the run's config from DIR/config.json and restores its parameters only, onto this machine's
mesh (as `python -m moc_jax.eval` does), tokenizes with the run's tokenizer and decodes with a fixed-size
KV cache (model/decode.py): one jitted prefill over the prompt, then one jitted `lax.while_loop` that
samples a token per step and stops after N tokens or once every row has produced EOS (or the end-of-turn
token). `--routing` sets `memory.decode_routing` (docs/generation.md). The text goes to stdout, a
JSON summary to stderr; bad input exits with code 2 and a message naming the fix.
"""
from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from moc_jax import cli, sharding
from moc_jax.config import load_run_config, reads_cluster_paths, validate
from moc_jax.config.schema import DECODE_ROUTINGS, base_config
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax.errors import ConfigError, UsageError
from moc_jax.model import decode
from moc_jax.model.routing import resolve_decode_routing
from moc_jax.state import build_state, restore_params

NOT_GENERATED = -1  # output slots after a row stopped


def sample(logits, key, temperature, top_p):
  """Next tokens [B] from logits [B, V]: the argmax at temperature 0; otherwise a draw from
  softmax(logits / temperature) restricted to the most probable tokens whose mass reaches top_p
  (nucleus). temperature and top_p may be traced: one compiled decode loop serves every setting."""
  scaled = logits / jnp.maximum(temperature, 1e-6)
  ranked = jnp.sort(scaled, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(ranked, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more probable tokens
  cutoff = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
  nucleus = jnp.where((scaled >= cutoff) | (top_p >= 1), scaled, -jnp.inf)
  return jnp.where(temperature == 0, jnp.argmax(logits, axis=-1), jax.random.categorical(key, nucleus, axis=-1))


def _prefill(graphdef, params, ids, valid, *, max_len):
  model = nnx.merge(graphdef, params)
  cache, logits = decode.step(model, decode.init_cache(model, ids.shape[0], max_len), ids, valid)
  return logits[:, -1], cache


def _decode(graphdef, stop_ids, pad_id, vocab_size, params, cache, logits, key, temperature, top_p, *, num_new):
  """Samples num_new tokens per row from the prompt's last logits, feeding each back through the cache;
  a stopped row feeds padding (no slot, no position) and records NOT_GENERATED."""
  model = nnx.merge(graphdef, params)
  stops = jnp.asarray(stop_ids, jnp.int32)

  def pick(logits, i):
    if vocab_size is not None:  # never sample ids the tokenizer cannot decode
      logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    return sample(logits, jax.random.fold_in(key, i), temperature, top_p).astype(jnp.int32)

  def body(carry):
    i, token, cache, out, done = carry
    cache, logits = decode.step(model, cache, jnp.where(done, pad_id, token)[:, None], ~done[:, None])
    token = jnp.where(done, NOT_GENERATED, pick(logits[:, -1], i))
    return i + 1, token, cache, out.at[:, i].set(token), done | jnp.isin(token, stops)

  first = pick(logits, 0)
  out = jnp.full((logits.shape[0], num_new), NOT_GENERATED, jnp.int32).at[:, 0].set(first)
  carry = (jnp.int32(1), first, cache, out, jnp.isin(first, stops))
  return jax.lax.while_loop(lambda c: (c[0] < num_new) & ~jnp.all(c[4]), body, carry)[3]


class Generator:
  """Jitted prefill and decode loop for one model structure; parameters are passed per call, and a
  call compiles once per (batch, prompt length, max_new_tokens), not per token or sampling setting."""

  def __init__(self, graphdef, *, stop_ids=(), pad_id=0, vocab_size=None):
    self.pad_id = pad_id
    self.stop_ids = tuple(stop_ids)
    self.prefill = jax.jit(functools.partial(_prefill, graphdef), static_argnames="max_len")
    self.decode = jax.jit(functools.partial(_decode, graphdef, self.stop_ids, pad_id, vocab_size),
                          static_argnames="num_new")

  def __call__(self, params, prompts, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=0):
    """prompts: token lists (left-padded to one length) -> the new tokens of each, stop token excluded."""
    ids, valid = left_pad(prompts, self.pad_id)
    logits, cache = self.prefill(params, ids, valid, max_len=ids.shape[1] + max_new_tokens)
    out = self.decode(params, cache, logits, jax.random.key(seed), jnp.float32(temperature), jnp.float32(top_p),
                      num_new=max_new_tokens)
    return [self._until_stop(row) for row in np.asarray(out)]

  def _until_stop(self, row):
    row = [int(t) for t in row if t != NOT_GENERATED]
    ends = [i for i, t in enumerate(row) if t in self.stop_ids]
    return row[:ends[0]] if ends else row


def left_pad(prompts, pad_id):
  """Token lists -> (ids [B, P] int32, valid [B, P] bool), padded on the left so every row's last
  prompt token sits in the same slot."""
  width = max(len(p) for p in prompts)
  ids = np.full((len(prompts), width), pad_id, np.int32)
  valid = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):], valid[i, width - len(p):] = p, True
  return jnp.asarray(ids), jnp.asarray(valid)


def run(workdir, prompts, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=0, step=None, routing=None,
        overrides=None):
  """The command line's work -> (completions, summary). The run's config and parameters are read as
  `python -m moc_jax.eval` reads them (`config.load_run_config`, `state.restore_params`)."""

  if routing is not None and routing not in DECODE_ROUTINGS:
    raise UsageError(f"--routing={routing}: unknown; use one of {list(DECODE_ROUTINGS)}")
  if not prompts:
    raise UsageError('give a prompt: --prompt "some text"')
  if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
    raise UsageError("need --max_new_tokens >= 1, --temperature >= 0 and 0 < --top_p <= 1")
  overrides = dict(overrides or {})
  if routing is not None:
    overrides["memory.decode_routing"] = routing
  config = load_run_config(workdir, overrides)
  validate(config)
  config.lock()
  if reads_cluster_paths(config):
    raise ConfigError(f"config.memory.routing: {workdir} reads its chapters by cluster paths, which cached decoding "
                      "does not compute yet — score prompts with `python -m moc_jax.eval` (probes read by their "
                      "prompt's path)")
  tokenizer = model_tokenizer(config)
  encoded = [tokenizer.encode(p) for p in prompts]
  limit, longest = config.model.max_seq_len, max(len(e) for e in encoded)
  if min(len(e) for e in encoded) == 0:
    raise UsageError("a --prompt encodes to no tokens; give some text")
  if longest >= limit:
    raise UsageError(f"the prompt is {longest} tokens and model.max_seq_len is {limit}, leaving no room to "
                     f"generate; shorten the prompt to under {limit} tokens (or raise "
                     "--config.model.max_seq_len, beyond the length the run trained on)")
  num_new = min(max_new_tokens, limit - longest)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    params, restored = restore_params(workdir, layout, step)
    gen = Generator(layout.graphdef, stop_ids=sorted({tokenizer.eos_id, tokenizer.eot_id}),
                    pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size)
    t0 = time.time()
    out = gen(params, encoded, num_new, temperature=temperature, top_p=top_p, seed=seed)
    seconds = time.time() - t0
  mem = config.memory
  routing = resolve_decode_routing(mem) if mem.kind == "chapters" else f"{mem.kind}: every token looks up its slots"
  summary = {"step": int(restored), "routing": routing if mem.enabled else "none",
             "prompt_tokens": [len(e) for e in encoded], "new_tokens": [len(o) for o in out],
             "seconds": round(seconds, 3)}
  if num_new < max_new_tokens:
    summary["capped_at_max_seq_len"] = num_new
  return [tokenizer.decode(o) for o in out], summary


def _define_flags():
  """Flags exist only when this module runs as the command (other entry points define theirs)."""
  cli.define_overrides_flag(base_config(), "Overrides of the run's saved config, e.g. --config.memory.routing_window=64.")
  flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints/).")
  flags.DEFINE_multi_string("prompt", None, "Prompt text; repeat the flag for a batch of prompts.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt (fewer if model.max_seq_len is reached).")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy; otherwise the sampling temperature.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: sample among the most probable tokens holding this mass.")
  flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
  flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the newest).")
  flags.DEFINE_string("routing", None, f"memory.decode_routing, one of {list(DECODE_ROUTINGS)} (default: the run's).")


def _main(argv):
  cli.begin(argv, datasets=False)
  f = flags.FLAGS
  if not f.workdir:
    raise UsageError("--workdir=DIR is required: the directory of a training run (config.json, checkpoints/)")
  texts, summary = run(f.workdir, f.prompt, f.max_new_tokens, temperature=f.temperature, top_p=f.top_p,
                       seed=f.seed, step=f.step, routing=f.routing, overrides=cli.override_values())
  for prompt, text in zip(f.prompt, texts):
    print(prompt + text)
  print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
  _define_flags()
  cli.run(_main)
