"""`python -m moc_jax.main --config=configs/moc.py:tiny --workdir=runs/tiny [--config.a.b=v] [--mode=eval]`.

train (default): trains, evaluates and checkpoints into the workdir, resuming if it holds checkpoints.
eval: evaluates the newest checkpoint of the workdir on the validation split (and fact-recall probes).
"""
from __future__ import annotations

import json
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Config file and argument, e.g. configs/moc.py:tiny.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config.json, checkpoints/, metrics.jsonl, loss.png.")
flags.DEFINE_enum("mode", "train", ["train", "eval"], "train (resumes automatically) or eval.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.config is None or FLAGS.workdir is None:
    raise app.UsageError("--config=PATH.py:ARG and --workdir=DIR are both required")
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)  # library INFO chatter (orbax, tfds) off the console
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()
  logging.getLogger("moc_jax").setLevel(logging.INFO)
  from moc_jax.config import ConfigError, validate
  from moc_jax.checkpoint import CheckpointError
  from moc_jax.data import DataError
  from moc_jax.train.loop import TrainingError, evaluate_checkpoint, train_and_evaluate
  try:
    validate(FLAGS.config)
    if FLAGS.mode == "train":
      train_and_evaluate(FLAGS.config, FLAGS.workdir)
    else:
      print(json.dumps(evaluate_checkpoint(FLAGS.config, FLAGS.workdir)))
  except (ConfigError, CheckpointError, DataError, TrainingError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
