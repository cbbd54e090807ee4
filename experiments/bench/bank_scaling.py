"""P4: step time as the bank grows 4K -> 4.2M tokens with the read held fixed, dense AdamW vs lazy Adam, per router.

Tokens per chapter (T), top-k and the backbone stay those of the config, so every size reads the same
(shared + top_k) x T tokens per sequence; only the number of chapters (the bank and the router's
output width) grows. With `train.bank_optimizer=dense` (MoC-PT's) what grows with the bank is its gradient
(a scatter-add into a bank-sized zero array), global-norm clipping and AdamW over every bank row, read or
not. With `lazy_adam` the bank's gradient and update cover the rows read (docs/results/2026-11-26-bank-scaling.md), and
what still grows is the router: with `memory.router=linear` its weights [d, chapters] per memory layer, their
gradient and AdamW and its logits over every chapter; with `product` (--routers) 2·sqrt(chapters)·d weights,
whose chapter logits the step never forms (model.routing.GridLogits).
Goal: the lazy step at the largest bank <= 1.1x the lazy step at the smallest (per router).
The optimizer update alone is timed per (size, router, optimizer) to show how much of the growth it is.
Every trainer is compiled up front and their steps interleaved, so they share background load, with an untimed
pause (--settle_s) before each: on a 2-core CPU a step that follows a dense step at the 4.2M bank takes 0.3 s
longer than one that follows itself, whatever its own bank size (common.interleave). A step's own trailing work
is then charged to no one: the dense steps at the largest banks are under-reported by up to that much.

Defaults: the tiny backbone (d = 64) with 32-token chapters, 8 sequences per micro-batch; the 4.2M-token
bank then holds 268M float32 values (1.07 GB; the dense trainer needs 4 such arrays and a gradient), which
fits beside the other sizes in ~12 GB per router and optimizer: on a 24 GB machine time the optimizers (or the
routers) in separate commands.

`--kind=pkm | hml` times a product-key memory instead (model/pkm.py, hml.py): `--sizes` are value slots, each a
square n^2 (64K to 4M by default: n = 256 to 2048), at the config's top-k, heads and value width, so every size
reads the same rows per token. What grows with the table is its gradient and update (lazy AdamW: the rows read
alone) and, by design, the product keys' scoring of 2n sub-keys per query head, O(sqrt(N) d_q) FLOPs that the
estimator counts (`flops_growth`; `step_growth_over_flops` is the growth the FLOPs do not explain). On a backbone
as narrow as tiny's the scoring outweighs the rest of the step at 4M slots; on the paper's it is a few percent
(`--config=configs/moc.py:262k,runlocal --set memory.pkm_value_dim=64`: 64-wide values fit the 4M table and its
moments in 3 GB; docs/results/2026-11-27-pkm-search-once.md). `--routers` does not apply.

`python -m experiments.bench.bank_scaling [--config=configs/moc.py:tiny] [--kind=chapters|pkm|hml] [--sizes 4096,...]
[--optimizers dense,lazy_adam] [--routers linear,product]`
"""
from __future__ import annotations

import math

import jax
from absl import flags
from flax import nnx

from experiments.bench import common
from moc_jax import abstract_model, cli, count_params
from moc_jax.config.schema import MEMORY_KINDS, ROUTERS as ALL_ROUTERS
from moc_jax.errors import ConfigError
from moc_jax.model.routing import BalanceBias

GOAL = 1.1
SIZES = (4096, 32768, 262144, 2097152, 4194304)
SLOT_SIZES = (65536, 262144, 1048576, 4194304)  # --kind=pkm | hml: value slots, n^2 for n = 256 ... 2048
OPTIMIZERS = ("dense", "lazy_adam")
ROUTERS = ("linear",)
TOKENS_PER_CHAPTER = 32

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:tiny", 8)
flags.DEFINE_enum("kind", "chapters", list(MEMORY_KINDS), "memory.kind to time", flag_values=_FLAGS)
common.define_int_list_flag(_FLAGS, "sizes", (), "bank tokens (chapters) or value slots (pkm, hml), ascending; "
                            f"default {','.join(map(str, SIZES))} or {','.join(map(str, SLOT_SIZES))}")
flags.DEFINE_list("optimizers", list(OPTIMIZERS), "train.bank_optimizer values to time", flag_values=_FLAGS)
flags.DEFINE_list("routers", list(ROUTERS), "memory.router values to time", flag_values=_FLAGS)
flags.DEFINE_integer("tokens_per_chapter", TOKENS_PER_CHAPTER, "T; 0: the config's", flag_values=_FLAGS)
flags.DEFINE_integer("rounds", 4, "rounds of interleaved steps", flag_values=_FLAGS)
flags.DEFINE_integer("steps_per_round", 1, "timed steps of each size per round", flag_values=_FLAGS)
flags.DEFINE_float("settle_s", 1.0, "untimed pause before each trainer's steps (see above)", flag_values=_FLAGS)
flags.DEFINE_integer("optimizer_reps", 3, "timed optimizer updates per size", flag_values=_FLAGS)


def run(config="configs/moc.py:tiny", batch_size=8, overrides=None, sizes=None, optimizers=OPTIMIZERS,
        tokens_per_chapter=TOKENS_PER_CHAPTER, rounds=4, steps_per_round=1, warmup=1, optimizer_reps=3,
        routers=ROUTERS, settle_s=1.0, kind="chapters") -> dict:
  chapters = kind == "chapters"
  sizes = sizes or (SIZES if chapters else SLOT_SIZES)
  base, _ = common.load(config, batch_size, {**(overrides or {}), "memory.kind": kind})
  per_chapter = tokens_per_chapter or base.memory.num_tokens // base.memory.num_chapters
  for flag, values, known in (("optimizers", optimizers, OPTIMIZERS), ("routers", routers, ALL_ROUTERS)):
    for value in values:
      if value not in known:
        raise ConfigError(f"flag --{flag}: {value!r} is not one of {', '.join(known)}")
  for field in ("memory.num_tokens", "memory.num_chapters", "memory.router", "train.bank_optimizer", "memory.kind",
                "memory.pkm_sub_keys"):
    if field in (overrides or {}):
      raise ConfigError(f"flag --set {field}: the benchmark sets it per trainer; use --kind, --sizes, "
                        "--tokens_per_chapter, --routers and --optimizers")
  arms = routers if chapters else (kind,)  # what each size is timed with besides its optimizer
  trainers = {}
  for size in sizes:
    for arm in arms:
      for opt in optimizers:
        cfg, _ = common.load(config, batch_size, {**(overrides or {}), **_sized(kind, arm, size, per_chapter),
                                                   "train.bank_optimizer": opt})
        trainers[size, arm, opt] = common.trainer(cfg)
        trainers[size, arm, opt].run(warmup)
  times = common.interleave(trainers, rounds, steps_per_round, settle_s)
  rows = []
  for (size, arm, opt), trainer in trainers.items():
    sized = ({"bank_tokens": size, "router": arm, "chapters": trainer.config.memory.num_chapters} if chapters
             else {"slots": size, "sub_keys": trainer.config.memory.pkm_sub_keys})
    extra = ({"router_params": _router_params(trainer.config)} if chapters
             else {"memory_layer_params": count_params(trainer.config)["memory_layers"]})
    rows.append({"kind": kind, **sized, "bank_optimizer": opt, "bank_params": count_params(trainer.config)["bank"],
                 **extra, "model_flops_per_step": trainer.flops_per_step, "step": common.summary(times[size, arm, opt]),
                 "optimizer": common.summary(trainer.time_optimizer(optimizer_reps))})
  size_key = "bank_tokens" if chapters else "slots"
  growth = {}
  for arm in arms:
    for opt in optimizers:
      first, last = (next(r for r in rows if (r[size_key], r.get("router", kind), r["bank_optimizer"]) == (s, arm, opt))
                     for s in (sizes[0], sizes[-1]))
      step_growth = last["step"]["median_s"] / first["step"]["median_s"]
      flops_growth = last["model_flops_per_step"] / first["model_flops_per_step"]
      growth.setdefault(arm, {})[opt] = {
          "step_growth": step_growth,
          "optimizer_growth": last["optimizer"]["median_s"] / first["optimizer"]["median_s"],
          "step_delta_s": last["step"]["median_s"] - first["step"]["median_s"],
          "optimizer_delta_s": last["optimizer"]["median_s"] - first["optimizer"]["median_s"],
          "flops_growth": flops_growth, "step_growth_over_flops": step_growth / flops_growth}
  mem = base.memory
  read = ({"tokens_per_chapter": per_chapter, "top_k": mem.top_k, "num_shared": mem.num_shared} if chapters
          else {"top_k": mem.pkm_top_k, "heads": mem.pkm_heads if kind == "pkm" else base.model.num_heads})
  return {"name": "bank_scaling", "config": config, "kind": kind, "overrides": overrides or {},
          "global_batch": [len(next(iter(trainers.values())).batch["input_ids"]), base.data.seq_len],
          **read, "sizes": rows, "growth": growth, "goal": f"lazy_adam step_growth <= {GOAL}",
          "pass": {arm: (g["lazy_adam"]["step_growth"] <= GOAL if "lazy_adam" in g else None)
                   for arm, g in growth.items()}}


def _sized(kind, router, size, per_chapter) -> dict:
  """The overrides of one size: `size` bank tokens in chapters of `per_chapter` tokens, read by `router`, or
  (pkm, hml) `size` = n^2 value slots."""
  if kind == "chapters":
    if size % per_chapter:
      raise ConfigError(f"flag --sizes: {size} is not a multiple of {per_chapter} tokens per chapter "
                        "(--tokens_per_chapter)")
    return {"memory.num_tokens": size, "memory.num_chapters": size // per_chapter, "memory.router": router}
  n = math.isqrt(size)
  if n * n != size:
    raise ConfigError(f"flag --sizes: {size} is not a square: a product-key table holds n^2 slots "
                      f"(e.g. {n * n} or {(n + 1) ** 2})")
  return {"memory.kind": kind, "memory.pkm_sub_keys": n}


def _router_params(config) -> int:
  """Weights and biases of every memory layer's router (not the aux-free bias: routing state, no gradient)."""
  routers = [b.memory.router for b in abstract_model(config).layers.blocks if b.memory is not None]
  state = nnx.state(routers, nnx.All(nnx.Param, nnx.Not(BalanceBias)))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), tuple(args.sizes),
                         tuple(args.optimizers), args.tokens_per_chapter, args.rounds, args.steps_per_round,
                         optimizer_reps=args.optimizer_reps, routers=tuple(args.routers), settle_s=args.settle_s,
                         kind=args.kind))


if __name__ == "__main__":
  main()
