"""P2: does a memory layer cost no more time than its FLOPs? MoC step time against its iso-FLOP vanilla.

metric = (median MoC step s / median vanilla step s) / (MoC / vanilla analytic model FLOPs per step).
1.0 means memory FLOPs run exactly as fast as backbone FLOPs; the goal is <= 1.05. Both models are
compiled in one process and their steps interleaved round by round, so they share background load.
The vanilla baseline is `configs/vanilla.py:iso=<moc name>` (depth chosen by training FLOPs).
The micro-batch defaults to 8 sequences (the config's 32 with --batch_size 32) so that the run
fits in ~5 minutes on 2 CPU cores.

`python -m experiments.bench.moc_vs_vanilla [--config=configs/moc.py:small] [--rounds 5] [--steps_per_round 2]`
"""
from __future__ import annotations

from absl import flags

from experiments.bench import common
from moc_jax import cli

GOAL = 1.05

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:small", 8)
flags.DEFINE_string("vanilla", None, "baseline config (default: configs/vanilla.py:iso=<moc name>)",
                    flag_values=_FLAGS)
flags.DEFINE_integer("rounds", 5, "rounds of interleaved steps", flag_values=_FLAGS)
flags.DEFINE_integer("steps_per_round", 2, "timed steps of each model per round", flag_values=_FLAGS)


def iso_vanilla(moc_spec: str) -> str:
  """configs/moc.py:small[,mods] -> configs/vanilla.py:iso=small[,mods]."""
  return "configs/vanilla.py:iso=" + moc_spec.partition(":")[2]


def run(config="configs/moc.py:small", batch_size=8, overrides=None, rounds=5, steps_per_round=2, warmup=1,
        vanilla=None) -> dict:
  vanilla = vanilla or iso_vanilla(config)
  moc_cfg, _ = common.load(config, batch_size, overrides)
  van_cfg, iso_note = common.load(vanilla, batch_size, overrides)
  trainers = {"moc": common.trainer(moc_cfg), "vanilla": common.trainer(van_cfg)}
  for trainer in trainers.values():
    trainer.run(warmup)
  times = common.interleave(trainers, rounds, steps_per_round)
  steps = {name: common.summary(t) for name, t in times.items()}
  time_ratio = steps["moc"]["median_s"] / steps["vanilla"]["median_s"]
  flop_ratio = trainers["moc"].flops_per_step / trainers["vanilla"].flops_per_step
  value = time_ratio / flop_ratio
  return {"name": "moc_vs_vanilla", "config": config, "vanilla": vanilla, "iso_choice": iso_note,
          "overrides": overrides or {}, "global_batch": [len(trainers["moc"].batch["input_ids"]), moc_cfg.data.seq_len],
          "layers": {"moc": moc_cfg.model.num_layers, "vanilla": van_cfg.model.num_layers},
          "step": steps, "model_flops_per_step": {n: t.flops_per_step for n, t in trainers.items()},
          "achieved_gflops_per_s": {n: trainers[n].flops_per_step / steps[n]["median_s"] / 1e9 for n in trainers},
          "time_ratio": time_ratio, "flop_ratio": flop_ratio, "time_over_flops": value,
          "goal": f"time_over_flops <= {GOAL}", "pass": value <= GOAL}


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), args.rounds,
                         args.steps_per_round, vanilla=args.vanilla))


if __name__ == "__main__":
  main()
