"""`python -m moc_jax.eval.background --workdir=RUN [--step=N] [--batches=32] [--split=train]`

Counts which chapters a trained run's routers read over the first `--batches` global batches of a split of its
own data (the pre-training data) and writes RUN/bank_background.json (moc_jax/bank_background.py: the format
and the idf that `train.bank_optimizer=smf` ranks against). Run it once on the pre-training run; the finetuning
runs that start from it (`--config.train.init_from=RUN`) find it there.
"""
from __future__ import annotations

import os

from absl import flags

from moc_jax import cli
from moc_jax.config import base_config
from moc_jax.errors import ConfigError

FLAGS = flags.FLAGS


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  cli.define_overrides_flag(base_config(), "Overrides of the run's saved config, e.g. --config.data.data_dir=DIR.")
  flags.DEFINE_string("workdir", None, "The pre-training run's directory (config.json, checkpoints/).")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
  flags.DEFINE_integer("batches", 32, "Global batches of the split to count (from its start, in file order).")
  flags.DEFINE_string("split", "train", "The split whose reads are the background.")
  flags.DEFINE_string("out", None, "Output path (default RUN/bank_background.json).")


def count_reads(config, workdir: str, split: str, step=None) -> dict:
  """{df [banks, C], decisions [banks], step}: for every bank, the routing decisions over the split's first
  `config.train.eval_batches` batches that selected each chapter (the shared chapters: all of them)."""
  from moc_jax import bank_background, sharding
  from moc_jax.config import bank_ids
  from moc_jax.eval.ce import CEEvaluator, split_batches
  from moc_jax.eval.routing import Usage
  from moc_jax.state import build_state, restore_params
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    params, step = restore_params(workdir, layout, step)
    usage = Usage(config)
    CEEvaluator(layout.graphdef, layout.shardings["params"], sharding.data_sharding(config, mesh),
                split_batches(config, split), routing=True)(params, usage.add)
  return {**bank_background.per_bank(usage.counts, usage.decisions, bank_ids(config), config.memory.num_shared),
          "step": step}


def main(argv):
  cli.begin(argv)
  from moc_jax import bank_background
  from moc_jax.config import memory_layers
  if FLAGS.batches < 1:
    raise ConfigError(f"--batches={FLAGS.batches}: count at least one batch")
  config = cli.run_config(FLAGS.workdir, {**cli.override_values(), "train.eval_batches": FLAGS.batches},
                          "the pre-training run")
  if not (config.memory.enabled and memory_layers(config)):
    raise ConfigError(f"{FLAGS.workdir} is a model without memory: there is no bank to count reads of")
  counts = count_reads(config, FLAGS.workdir, FLAGS.split, FLAGS.step)
  out = FLAGS.out or os.path.join(FLAGS.workdir, bank_background.FILENAME)
  bank_background.write(out, counts["df"], counts["decisions"], step=counts["step"], split=FLAGS.split,
                        batches=FLAGS.batches)
  read = (counts["df"][:, config.memory.num_shared:] > 0).mean()
  print(f"{out}: {int(counts['decisions'].sum())} decisions over {FLAGS.batches} batches of {FLAGS.split} "
        f"(step {counts['step']}); {read:.0%} of routable chapters read")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
