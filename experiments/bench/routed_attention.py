"""P6: routing per position without gathering keys and values per (token, chapter).

One memory layer (`model.memory.MemoryLayer`: router, norm, chapter read, W_o) built from the config,
differentiated with `jax.value_and_grad` w.r.t. the layer's parameters, the bank [C, T, d] and the
input h (which is also the routing input), loss = sum of the layer output + the weighted router aux
terms, in the config's compute dtype. Four variants of the same layer:

* `naive`     — token routing, `memory.attention_impl="reference"`: gathers the K/V of every
                (token, slot) chapter, [B, L, S, T, Hkv, dh];
* `sequence`  — MoC-PT's paper mode: one decision per row, gathers the row's (s + k) chapters;
* `token_xla` — token routing, `attention_impl="xla"`: bank K/V projected once, read slot by slot;
* `prefix_xla`— prefix routing (joint softmax), `attention_impl="xla"`.

Part 1 (compile only) lowers each variant at the 262k memory-layer shape (8 x 1024 tokens by
default) from ShapeDtypeStructs (nnx.eval_shape'd layer, abstract bank), nothing is allocated or run,
and reports XLA's `memory_analysis()`: temporaries (peak temp buffer), arguments, outputs. Goals:
temp(token_xla) / temp(sequence) <= 1.5 and temp(naive) / temp(token_xla) >= 20.
Part 2 runs the four variants' forward+backward at a small shape (`tiny`'s memory layer, 16 x 128 tokens),
all compiled first and then alternated round by round, and reports median CPU step times.
Goal: time(token_xla) / time(sequence) <= 2.

`python -m experiments.bench.routed_attention [--small_only]`
"""
from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from experiments.bench import common
from moc_jax import cli
from moc_jax.model.memory import ChapterBank, MemoryLayer

VARIANTS = {  # name -> (memory.routing, memory.attention_impl)
    "naive": ("token", "reference"),
    "sequence": ("sequence", "auto"),
    "token_xla": ("token", "xla"),
    "prefix_xla": ("prefix", "xla"),
}
GOALS = {  # ratio -> (comparison, bound)
    "temp_token_xla_over_sequence": ("<=", 1.5),
    "temp_naive_over_token_xla": (">=", 20.0),
    "time_token_xla_over_sequence": ("<=", 2.0),
}

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_string("config", "configs/moc.py:262k", "config of the compile-only part", flag_values=_FLAGS)
flags.DEFINE_integer("batch_size", 8, "sequences of the compile-only part", flag_values=_FLAGS)
flags.DEFINE_integer("seq_len", 1024, "tokens per sequence of the compile-only part", flag_values=_FLAGS)
flags.DEFINE_string("small_config", "configs/moc.py:tiny", "config of the timed part", flag_values=_FLAGS)
flags.DEFINE_integer("small_batch_size", 16, "sequences of the timed part", flag_values=_FLAGS)
flags.DEFINE_integer("small_seq_len", 128, "tokens per sequence of the timed part", flag_values=_FLAGS)
flags.DEFINE_integer("rounds", 5, "timing rounds (variants alternate)", flag_values=_FLAGS)
flags.DEFINE_integer("calls_per_round", 3, "timed calls of each variant per round", flag_values=_FLAGS)
flags.DEFINE_integer("warmup", 2, "untimed calls of each variant before timing", flag_values=_FLAGS)
flags.DEFINE_bool("small_only", False, "skip the compile-only part", flag_values=_FLAGS)
flags.DEFINE_list("variants", list(VARIANTS), "variants of the compile-only part", flag_values=_FLAGS)
flags.register_validator("variants", lambda names: set(names) <= set(VARIANTS),
                         f"each variant is one of {', '.join(VARIANTS)}", flag_values=_FLAGS)
common.define_set_flag(_FLAGS, "config override applied to both parts")


def meets(key, value):
  """Whether `value` meets goal `key` (None when the ratio could not be measured)."""
  if value is None:
    return None
  op, bound = GOALS[key]
  return value <= bound if op == "<=" else value >= bound


def layer_config(config, routing, impl, overrides=None):
  cfg, _ = common.load(config, None, {**(overrides or {}), "memory.routing": routing,
                                      "memory.attention_impl": impl})
  return cfg


def build(cfg, abstract: bool):
  """(graphdef, layer params, bank [C, T, d]) of one memory layer of `cfg` and its (single) bank."""
  def make():
    return MemoryLayer(cfg, nnx.Rngs(params=cfg.seed)), ChapterBank(cfg, 1, nnx.Rngs(params=cfg.seed + 1))
  layer, bank = nnx.eval_shape(make) if abstract else make()
  graphdef, params = nnx.split(layer, nnx.Param)
  bank = bank.memory.get_value()
  if abstract:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return graphdef, params, jax.ShapeDtypeStruct(bank.shape[1:], bank.dtype)
  return graphdef, params, bank[0]


def loss_and_grads(graphdef, cfg):
  """value_and_grad of (params, bank, h) -> sum(layer output) + router aux terms, w.r.t. all three."""
  mem = cfg.memory

  def loss(params, bank, h):
    out, stats = nnx.merge(graphdef, params)(h, h, bank)
    aux = mem.load_balance_coef * stats["load_balance"] + mem.z_loss_coef * stats["z_loss"] \
        + mem.mse_aux_coef * stats["mse_aux"]
    return jnp.sum(out.astype(jnp.float32)) + aux

  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def shapes(cfg, batch, length) -> dict:
  mem = cfg.memory
  t = mem.num_tokens // mem.num_chapters
  return {"batch": batch, "seq_len": length, "tokens": batch * length, "d_model": cfg.model.d_model,
          "chapters": mem.num_chapters, "chapter_tokens": t, "num_shared": mem.num_shared, "top_k": mem.top_k,
          "heads": mem.num_heads, "kv_heads": mem.num_kv_heads, "head_dim": cfg.model.d_model // mem.num_heads,
          "compute_dtype": cfg.model.compute_dtype}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}
_VALUE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")


def largest_values(hlo_text: str, n: int = 5) -> list[dict]:
  """The n largest array shapes the compiled program defines (all computations, loop bodies included),
  each with the first op that makes one: what the temporaries are made of (not a liveness analysis)."""
  seen = {}
  for line in hlo_text.splitlines():
    m = _VALUE.match(line)
    if not m or m.group(2) not in _DTYPE_BYTES or m.group(4) in ("parameter", "bitcast", "get-tuple-element"):
      continue
    dims = [int(x) for x in m.group(3).split(",") if x]
    nbytes = _DTYPE_BYTES[m.group(2)] * int(np.prod(dims, dtype=np.int64))
    op = re.search(r'op_name="([^"]*)"', line)
    shape = f"{m.group(2)}[{m.group(3)}]"
    where = (op.group(1) if op else m.group(4)).replace("jit(loss)/", "")
    if shape not in seen:
      seen[shape] = {"bytes": nbytes, "shape": shape, "op": where[-120:]}
  return sorted(seen.values(), key=lambda v: -v["bytes"])[:n]


def compile_variant(cfg, batch, length) -> dict:
  """Lowers and compiles one variant from abstract inputs; XLA's memory analysis (never executed)."""
  graphdef, params, bank = build(cfg, abstract=True)
  h = jax.ShapeDtypeStruct((batch, length, cfg.model.d_model), jnp.float32)
  t0 = time.perf_counter()
  try:
    compiled = jax.jit(loss_and_grads(graphdef, cfg)).lower(params, bank, h).compile()
  except Exception as e:  # noqa: BLE001  (reported, not hidden: e.g. XLA refusing a buffer size)
    return {"compiled": False, "error": f"{type(e).__name__}: {str(e)[:500]}",
            "compile_s": time.perf_counter() - t0}
  compile_s = time.perf_counter() - t0
  m = compiled.memory_analysis()
  return {"compiled": True, "compile_s": compile_s, "temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes), "largest_values": largest_values(compiled.as_text())}


def compile_for_timing(cfg, batch, length):
  """(compiled step, its concrete inputs, compile seconds, whether loss and grads are finite)."""
  graphdef, params, bank = build(cfg, abstract=False)
  h = jax.random.normal(jax.random.key(0), (batch, length, cfg.model.d_model), jnp.float32)
  t0 = time.perf_counter()
  compiled = jax.jit(loss_and_grads(graphdef, cfg)).lower(params, bank, h).compile()
  compile_s = time.perf_counter() - t0
  value, grads = compiled(params, bank, h)
  finite = bool(np.isfinite(float(value))) and all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  return compiled, (params, bank, h), compile_s, finite


def ratio(a, b):
  return None if a is None or b is None or not b else a / b


def large_part(config, batch, length, overrides, variants) -> dict:
  per = {}
  cfg = None
  for name in variants:
    cfg = layer_config(config, *VARIANTS[name], overrides)
    per[name] = compile_variant(cfg, batch, length)
  temp = {name: r.get("temp_bytes") for name, r in per.items()}
  return {"config": config, "overrides": overrides or {}, "shape": shapes(cfg, batch, length), "variants": per,
          "temp_token_xla_over_sequence": ratio(temp.get("token_xla"), temp.get("sequence")),
          "temp_prefix_xla_over_sequence": ratio(temp.get("prefix_xla"), temp.get("sequence")),
          "temp_naive_over_token_xla": ratio(temp.get("naive"), temp.get("token_xla"))}


def small_part(config, batch, length, overrides, rounds, calls_per_round, warmup) -> dict:
  """Compiles the four variants, then alternates `calls_per_round` timed calls of each for `rounds`
  rounds (every variant sees the same stretches of background load); medians per variant."""
  steps, per, cfg = {}, {}, None
  for name, (routing, impl) in VARIANTS.items():
    cfg = layer_config(config, routing, impl, overrides)
    compiled, args, compile_s, finite = compile_for_timing(cfg, batch, length)
    steps[name] = (lambda c, a: lambda: c(*a))(compiled, args)
    common.time_calls(steps[name], 0, warmup)
    per[name] = {"compile_s": compile_s, "finite": finite}
  times = {name: [] for name in steps}
  for _ in range(rounds):
    for name, step in steps.items():
      times[name] += common.time_calls(step, calls_per_round, 0)
  for name in steps:
    per[name]["step"] = common.summary(times[name])
  med = {name: r["step"]["median_s"] for name, r in per.items()}
  return {"config": config, "overrides": overrides or {}, "shape": shapes(cfg, batch, length), "variants": per,
          "time_token_xla_over_sequence": med["token_xla"] / med["sequence"],
          "time_prefix_xla_over_sequence": med["prefix_xla"] / med["sequence"],
          "time_naive_over_token_xla": med["naive"] / med["token_xla"]}


def run(large_config="configs/moc.py:262k", large_batch=8, large_len=1024, small_config="configs/moc.py:tiny",
        small_batch=16, small_len=128, overrides=None, rounds=5, calls_per_round=3, warmup=2, small_only=False,
        large_variants=tuple(VARIANTS)) -> dict:
  result = {"name": "routed_attention", "config": small_config if small_only else large_config,
            "small_config": small_config}
  ratios = {}
  if not small_only:
    result["large"] = large_part(large_config, large_batch, large_len, overrides, large_variants)
    ratios.update({k: result["large"][k] for k in ("temp_token_xla_over_sequence", "temp_naive_over_token_xla")})
  result["small"] = small_part(small_config, small_batch, small_len, overrides, rounds, calls_per_round, warmup)
  ratios["time_token_xla_over_sequence"] = result["small"]["time_token_xla_over_sequence"]
  result["goal"] = {k: f"{k} {GOALS[k][0]} {GOALS[k][1]}" for k in ratios}
  result["goal_met"] = {k: meets(k, v) for k, v in ratios.items()}
  result["pass"] = all(v is True for v in result["goal_met"].values())
  return result


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, args.seq_len, args.small_config, args.small_batch_size,
                         args.small_seq_len, common.parse_overrides(args.set), args.rounds, args.calls_per_round,
                         args.warmup, args.small_only, tuple(args.variants)))


if __name__ == "__main__":
  main()
