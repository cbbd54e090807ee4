"""Step time of several configs relative to the first, their steps interleaved in one process.

A study's time arithmetic (configs/capacity.py's docstring: each model's cost in runs of the narrow backbone) needs
what a step of each model costs on the machine, not what its FLOPs say: small models spend much of a step outside
their matmuls, and memory reads gather. Every config's production train step is compiled in one process and timed
round by round, so all of them see the same stretches of background load; each row gives the ratio of median step
times to the first config's beside the ratio of model FLOPs per step, the estimate it replaces. With several batch
sizes (`--batch_size=32,128`) every config runs at each, and `row_ratio` compares the time per row: whether bigger
updates buy throughput on this machine (the unit is the first config at the first size).

`python -m experiments.bench.step_ratio --config=configs/capacity.py:dense --config=configs/capacity.py:wide
[--batch_size N[,N...]] [--rounds 5] [--steps_per_round 2] [--set KEY=VALUE]`
"""
from __future__ import annotations

from absl import flags

from experiments.bench import common
from moc_jax import cli
from moc_jax.errors import UsageError

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_multi_string("config", None, "config spec, repeatable; the first is the unit", flag_values=_FLAGS)
common.define_int_list_flag(_FLAGS, "batch_size", (), "sequences per micro-batch (train.batch_size), one or more; "
                            "default: each config's")
common.define_set_flag(_FLAGS, "config override for every config, e.g. --set data.seq_len=64")
flags.DEFINE_integer("rounds", 5, "rounds of interleaved steps", flag_values=_FLAGS)
flags.DEFINE_integer("steps_per_round", 2, "timed steps of each config per round", flag_values=_FLAGS)


def run(configs: list[str], batch_sizes=(), overrides=None, rounds=5, steps_per_round=2, warmup=1) -> dict:
  keys = [(spec, size) for size in (batch_sizes or [None]) for spec in configs]
  trainers = {key: common.trainer(common.load(key[0], key[1], overrides)[0]) for key in keys}
  for trainer in trainers.values():
    trainer.run(warmup)
  steps = {key: common.summary(t) for key, t in common.interleave(trainers, rounds, steps_per_round).items()}
  rows_of = {key: trainers[key].config.train.batch_size * trainers[key].config.train.grad_accum for key in keys}
  unit = keys[0]
  rows = [{"config": spec, "batch_size": rows_of[(spec, size)], "step": steps[(spec, size)],
           "flops_per_step": trainers[(spec, size)].flops_per_step,
           "time_ratio": steps[(spec, size)]["median_s"] / steps[unit]["median_s"],
           "row_ratio": (steps[(spec, size)]["median_s"] / rows_of[(spec, size)])
           / (steps[unit]["median_s"] / rows_of[unit]),
           "flop_ratio": trainers[(spec, size)].flops_per_step / trainers[unit].flops_per_step} for spec, size in keys]
  return {"name": "step_ratio", "config": unit[0], "overrides": overrides or {}, "rows": rows,
          "goal": "none: a measurement", "pass": True}


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  if not args.config:
    raise UsageError("--config: give at least one config spec (the first is the unit), e.g. "
                         "--config=configs/capacity.py:dense --config=configs/capacity.py:wide")
  if any(size < 1 for size in args.batch_size):
    raise UsageError(f"--batch_size={','.join(map(str, args.batch_size))}: give sizes of at least 1, e.g. "
                     "--batch_size=32,128")
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), args.rounds,
                         args.steps_per_round))


if __name__ == "__main__":
  main()
