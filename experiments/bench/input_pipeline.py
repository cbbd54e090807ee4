"""Input pipeline time per batch of one or more configs, their batches interleaved in one process.

A small model's update can wait on its input more than on its step (`data_wait` in the train log: about half of the
d 32 backbone's updates in words on the 2-core AMD EPYC). This times `make_train_iterator` alone, without its
prefetch thread, so each batch costs the CPU work of reading, tokenizing and packing it; the configs' iterators take
turns round by round, so all of them see the same stretches of background load. Beside `step_ratio`'s step times it
tells how much of an update the pipeline is, and what a change to it buys (docs/performance.md).

`python -m experiments.bench.input_pipeline --config=configs/capacity.py:dense,words [--config=SPEC ...]
[--rounds 8] [--batches_per_round 50] [--set KEY=VALUE]`
"""
from __future__ import annotations

import contextlib
import sys
import time

from absl import flags

from experiments.bench import common
from moc_jax import cli
from moc_jax.data import make_train_iterator
from moc_jax.errors import UsageError

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_multi_string("config", None, "config spec, repeatable", flag_values=_FLAGS)
common.define_set_flag(_FLAGS, "config override for every config, e.g. --set data.num_threads=4")
flags.DEFINE_integer("rounds", 8, "rounds of interleaved batches", flag_values=_FLAGS)
flags.DEFINE_integer("batches_per_round", 50, "timed batches of each config per round", flag_values=_FLAGS)


def run(configs: list[str], overrides=None, rounds=8, batches_per_round=50, warmup=20) -> dict:
  iterators = {}
  for spec in configs:
    data = common.load(spec, None, overrides)[0].data
    data.prefetch = 0  # the pipeline's own work, not a thread that hides it
    with contextlib.redirect_stdout(sys.stderr):  # a corpus built on first use says so; stdout is the result's
      iterators[spec] = (data, make_train_iterator(data))
      for _ in range(warmup):  # opens the source and fills the read threads' buffer
        next(iterators[spec][1])
  seconds = {spec: [] for spec in configs}
  for r in range(rounds):
    for spec in configs if r % 2 == 0 else configs[::-1]:
      it = iterators[spec][1]
      start = time.perf_counter()
      for _ in range(batches_per_round):
        next(it)
      seconds[spec].append((time.perf_counter() - start) / batches_per_round)
  rows = []
  for spec in configs:
    data, batch = iterators[spec][0], common.summary(seconds[spec])
    rows.append({"config": spec, "batch": batch, "rows_per_s": data.batch_size / batch["median_s"],
                 "tokens_per_s": data.batch_size * data.seq_len / batch["median_s"]})
  return {"name": "input_pipeline", "config": configs[0], "overrides": overrides or {}, "rows": rows,
          "goal": "none: a measurement", "pass": True}


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  if not args.config:
    raise UsageError("--config: give at least one config spec, e.g. --config=configs/capacity.py:dense,words")
  if args.rounds < 1 or args.batches_per_round < 1:
    raise UsageError(f"--rounds={args.rounds} --batches_per_round={args.batches_per_round}: give at least 1 each")
  return common.emit(run(args.config, common.parse_overrides(args.set), args.rounds, args.batches_per_round))


if __name__ == "__main__":
  main()
