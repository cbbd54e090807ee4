"""Step time of several configs relative to the first, their steps interleaved in one process.

A study's time arithmetic (configs/capacity.py's docstring: each model's cost in runs of the narrow backbone) needs
what a step of each model costs on the machine, not what its FLOPs say: small models spend much of a step outside
their matmuls, and memory reads gather. Every config's production train step is compiled in one process and timed
round by round, so all of them see the same stretches of background load; each row gives the ratio of median step
times to the first config's beside the ratio of model FLOPs per step, the estimate it replaces.

`python -m experiments.bench.step_ratio --config=configs/capacity.py:dense --config=configs/capacity.py:wide
[--batch_size N] [--rounds 5] [--steps_per_round 2] [--set KEY=VALUE]`
"""
from __future__ import annotations

from absl import flags

from experiments.bench import common
from moc_jax import cli
from moc_jax.errors import UsageError

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_multi_string("config", None, "config spec, repeatable; the first is the unit", flag_values=_FLAGS)
flags.DEFINE_integer("batch_size", None, "sequences per micro-batch (train.batch_size); default: each config's",
                     flag_values=_FLAGS)
common.define_set_flag(_FLAGS, "config override for every config, e.g. --set data.seq_len=64")
flags.DEFINE_integer("rounds", 5, "rounds of interleaved steps", flag_values=_FLAGS)
flags.DEFINE_integer("steps_per_round", 2, "timed steps of each config per round", flag_values=_FLAGS)


def run(configs: list[str], batch_size=None, overrides=None, rounds=5, steps_per_round=2, warmup=1) -> dict:
  trainers = {spec: common.trainer(common.load(spec, batch_size, overrides)[0]) for spec in configs}
  for trainer in trainers.values():
    trainer.run(warmup)
  steps = {spec: common.summary(t) for spec, t in common.interleave(trainers, rounds, steps_per_round).items()}
  unit = configs[0]
  rows = [{"config": spec, "step": steps[spec], "flops_per_step": trainers[spec].flops_per_step,
           "time_ratio": steps[spec]["median_s"] / steps[unit]["median_s"],
           "flop_ratio": trainers[spec].flops_per_step / trainers[unit].flops_per_step} for spec in configs]
  return {"name": "step_ratio", "config": unit, "overrides": overrides or {}, "rows": rows,
          "goal": "none: a measurement", "pass": True}


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  if not args.config:
    raise UsageError("--config: give at least one config spec (the first is the unit), e.g. "
                         "--config=configs/capacity.py:dense --config=configs/capacity.py:wide")
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), args.rounds,
                         args.steps_per_round))


if __name__ == "__main__":
  main()
