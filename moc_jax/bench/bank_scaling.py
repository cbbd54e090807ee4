"""P4: step time as the bank grows 4K -> 262K tokens with the read held fixed.

Tokens per chapter (T), top-k and the backbone stay those of the config, so every size reads the same
(shared + top_k) x T tokens per sequence; only the number of chapters (the bank and the router's
output width) grows. Goal: median step time at the largest bank <= 1.3x the smallest. What still
grows with the bank is dense: its gradient (a scatter-add into a bank-sized zero array), global-norm
clipping, and AdamW over every bank row, read or not. The optimizer update alone
(tx.update + apply_updates) is timed per size to show how much of the growth it is.
All sizes are compiled up front and their steps interleaved, so they share background load.
The micro-batch defaults to 8 sequences (the config's 32 with --batch_size 32) so that the run
fits in ~5 minutes on 2 CPU cores.

`python -m moc_jax.bench.bank_scaling [--config=configs/moc.py:small] [--sizes 4096,16384,65536,262144]`
"""
from __future__ import annotations

from absl import flags

from moc_jax import cli, count_params
from moc_jax.bench import common

GOAL = 1.3
SIZES = (4096, 16384, 65536, 262144)

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:small", 8)
common.define_int_list_flag(_FLAGS, "sizes", SIZES, "bank tokens, ascending")
flags.DEFINE_integer("rounds", 4, "rounds of interleaved steps", flag_values=_FLAGS)
flags.DEFINE_integer("steps_per_round", 1, "timed steps of each size per round", flag_values=_FLAGS)
flags.DEFINE_integer("optimizer_reps", 3, "timed optimizer updates per size", flag_values=_FLAGS)


def run(config="configs/moc.py:small", batch_size=8, overrides=None, sizes=SIZES, rounds=4, steps_per_round=1,
        warmup=1, optimizer_reps=3) -> dict:
  base, _ = common.load(config, batch_size, overrides)
  per_chapter = base.memory.num_tokens // base.memory.num_chapters
  trainers = {}
  for size in sizes:
    if size % per_chapter:
      raise ValueError(f"bank size {size} is not a multiple of {per_chapter} tokens per chapter")
    cfg, _ = common.load(config, batch_size, {**(overrides or {}), "memory.num_tokens": size,
                                               "memory.num_chapters": size // per_chapter})
    trainers[size] = common.trainer(cfg)
    trainers[size].run(warmup)
  times = common.interleave(trainers, rounds, steps_per_round)
  rows = []
  for size, trainer in trainers.items():
    rows.append({"bank_tokens": size, "chapters": trainer.config.memory.num_chapters,
                 "bank_params": count_params(trainer.config)["bank"],
                 "model_flops_per_step": trainer.flops_per_step, "step": common.summary(times[size]),
                 "optimizer": common.summary(trainer.time_optimizer(optimizer_reps))})
  first, last = rows[0], rows[-1]
  step_growth = last["step"]["median_s"] / first["step"]["median_s"]
  step_delta = last["step"]["median_s"] - first["step"]["median_s"]
  opt_delta = last["optimizer"]["median_s"] - first["optimizer"]["median_s"]
  return {"name": "bank_scaling", "config": config, "overrides": overrides or {},
          "global_batch": [len(trainers[sizes[0]].batch["input_ids"]), base.data.seq_len],
          "tokens_per_chapter": per_chapter, "top_k": base.memory.top_k, "num_shared": base.memory.num_shared,
          "sizes": rows, "step_growth": step_growth,
          "flops_growth": last["model_flops_per_step"] / first["model_flops_per_step"],
          "optimizer_growth": last["optimizer"]["median_s"] / first["optimizer"]["median_s"],
          "step_delta_s": step_delta, "optimizer_delta_s": opt_delta,
          "goal": f"step_growth <= {GOAL}", "pass": step_growth <= GOAL}


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), tuple(args.sizes),
                         args.rounds, args.steps_per_round, optimizer_reps=args.optimizer_reps))


if __name__ == "__main__":
  main()
