"""`python -m moc_jax.eval --workdir=DIR [--step=N] [--split=validation] [--mcq=name:path[,name:path]]
[--mcq_dev=name:path] [--shots=K] [--ablate_chapters=3,17|top:N|routed|level:L] [--quantize_bank=int8|int4]
[--noanalyze_routing] [--config.a.b=v ...]`

Evaluates a training run's checkpoint: the run's config.json (with `--config.` overrides on top; the mesh
defaults to this machine's devices), parameters only, restored onto this mesh. Writes DIR/eval.json (or
--out) and the routing plots beside it, and prints a markdown summary. A run whose routing is not causal
(`sequence`, `segment`) also gets the CE of its weights routed causally (`prefix`), so the future-token leak in its
own CE shows beside it. Bad input exits with code 2 and one message naming the file or field and the fix.
"""
from __future__ import annotations


from absl import flags

from moc_jax import cli
from moc_jax.config import base_config
from moc_jax.errors import ConfigError, DataError
from moc_jax.eval.probes import DOC_BUCKET_EDGES

cli.define_overrides_flag(base_config(), "Overrides of the run's saved config, e.g. --config.data.data_dir=DIR or "
                      "--config.mesh.memory=4.")
flags.DEFINE_string("workdir", None, "The training run's directory (config.json, checkpoints/).")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
flags.DEFINE_string("split", "validation", "Split for CE / perplexity (any the data layer reads, e.g. paraphrase).")
flags.DEFINE_string("out", None, "Report path (default DIR/eval.json); routing plots are written beside it.")
flags.DEFINE_list("mcq", [], "Multiple-choice benchmarks as name:path.jsonl (ARC, BoolQ, OpenBookQA, MMLU, "
                  "HellaSwag shapes; see moc_jax/eval/mcq.py).")
flags.DEFINE_list("mcq_dev", [], "k-shot example files as name:path.jsonl (same names as --mcq).")
flags.DEFINE_integer("shots", 0, "k-shot examples before each question (needs --mcq_dev).")
flags.DEFINE_integer("mcq_limit", 0, "> 0: score only the first N questions of each benchmark.")
flags.DEFINE_integer("num_probes", None, "Fact-recall probes (default train.num_probes, the training log's "
                     "sample; 0: every probe of an entity seen in training).")
flags.DEFINE_list("bucket_edges", [str(e) for e in DOC_BUCKET_EDGES],
                  "Training-document counts where the recall buckets start.")
flags.DEFINE_bool("analyze_routing", True, "Chapter usage, entropy, stability and plots per memory layer.")
flags.DEFINE_string("ablate_chapters", None, "Zero these chapters of the bank (value slots of a pkm / hml table) and "
                    "report the CE and fact-recall change: comma-separated ids, top:N (the N most used), routed "
                    "(every routable chapter; every slot of a table) or, under cluster routing, level:L[,L] (the "
                    "chapters the tree's level L owns; 0 the root's children).")
flags.DEFINE_enum("quantize_bank", None, ["int8", "int4"], "Also evaluate with the bank stored as int8 / int4 "
                  "per-row absmax codes (moc_jax/model/quantize.py) and report the change against the float bank.")
FLAGS = flags.FLAGS


def _pairs(entries, flag):
  out = {}
  for entry in entries:
    name, sep, path = entry.partition(":")
    if not sep or not name or not path:
      raise DataError(f"--{flag} entry {entry!r} must be name:path/to/file.jsonl")
    out[name] = path
  return out


def _options():
  from moc_jax.eval.run import EvalOptions
  try:
    edges = tuple(sorted(int(e) for e in FLAGS.bucket_edges))
  except ValueError as e:
    raise ConfigError(f"--bucket_edges={','.join(FLAGS.bucket_edges)}: use comma-separated integers") from e
  if FLAGS.shots < 0 or FLAGS.mcq_limit < 0:
    raise ConfigError("--shots and --mcq_limit must be >= 0")
  return EvalOptions(step=FLAGS.step, split=FLAGS.split, num_probes=FLAGS.num_probes, bucket_edges=edges,
                     mcq=_pairs(FLAGS.mcq, "mcq"), mcq_dev=_pairs(FLAGS.mcq_dev, "mcq_dev"), shots=FLAGS.shots,
                     mcq_limit=FLAGS.mcq_limit, analyze_routing=FLAGS.analyze_routing,
                     ablate_chapters=FLAGS.ablate_chapters, quantize_bank=FLAGS.quantize_bank, out=FLAGS.out)


def main(argv):
  cli.begin(argv)
  from moc_jax.eval.run import evaluate, markdown_table
  options = _options()
  config = cli.run_config(FLAGS.workdir, cli.override_values())
  print(markdown_table(evaluate(config, FLAGS.workdir, options)))


if __name__ == "__main__":
  cli.run(main)
