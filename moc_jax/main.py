"""`python -m moc_jax.main --config=configs/moc.py:tiny --workdir=runs/tiny [--config.a.b=v] [--mode=...]`.

train (default): trains, evaluates and checkpoints into the workdir, resuming if it holds checkpoints.
eval: evaluates the newest checkpoint of the workdir as `python -m moc_jax.eval` does, under --config.
compile: lowers and compiles the train step for the configured mesh and prints a per-device memory
  report as one JSON line (no workdir needed; `--config.num_fake_devices=8` on a CPU).
Multi-host: `--distributed` (TPU pods, SLURM: detected by JAX) or `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (also from MOC_JAX_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID);
every process runs the same command and feeds its own slice of each batch.
"""
from __future__ import annotations

from absl import flags

from moc_jax import cli
from moc_jax.errors import ConfigError, UsageError

FLAGS = flags.FLAGS


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  cli.define_config_file_flag("Config file and argument, e.g. configs/moc.py:tiny.")
  flags.DEFINE_string("workdir", None, "Run directory: config.json, checkpoints/, metrics.jsonl, loss.png.")
  flags.DEFINE_enum("mode", "train", ["train", "eval", "compile"], "train (resumes automatically), eval or compile.")
  flags.DEFINE_bool("distributed", False, "Join a multi-process run (jax.distributed; cluster auto-detected).")
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 for a multi-process run.")
  flags.DEFINE_integer("num_processes", None, "Processes in the multi-process run.")
  flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def train(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints) with the standard validation
  evaluation (CE, and fact recall on moc_facts); returns the last metrics."""
  from moc_jax.eval.validation import ValidationEvaluator
  from moc_jax.train.loop import train_and_evaluate
  return train_and_evaluate(config, workdir, ValidationEvaluator)


def main(argv):
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.config is None or (FLAGS.workdir is None and FLAGS.mode != "compile"):
    raise UsageError("--config=PATH.py:ARG and --workdir=DIR are both required")
  cli.quiet_libraries()
  cli.quiet_datasets()
  import jax

  from moc_jax import distributed
  from moc_jax.config import validate
  cli.use_fake_devices(FLAGS.config.num_fake_devices)  # both before the first use of a JAX backend
  try:
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.distributed)
  except ValueError as e:  # a malformed address / process id: named by the message
    raise ConfigError(str(e)) from e
  validate(FLAGS.config)
  note = FLAGS.workdir and distributed.workdir_note(FLAGS.workdir, jax.process_count())
  if note:
    distributed.log.warning(note)
  if FLAGS.mode == "train":
    train(FLAGS.config, FLAGS.workdir)
  elif FLAGS.mode == "eval":  # the same evaluation as `python -m moc_jax.eval`, under this --config
    from moc_jax.eval import evaluate, markdown_table
    print(markdown_table(evaluate(FLAGS.config, FLAGS.workdir)))
  else:
    from moc_jax import compile_report
    compile_report.main(FLAGS.config)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
