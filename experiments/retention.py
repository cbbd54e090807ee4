"""`python -m experiments.retention --out=DIR [--quick] [--parallel=2] [--config=configs/moc.py:tiny]`

Does memory protect what a model knew when it learns something new? The protocol (docs/retention.md):

  phase 1  MoC and its iso-FLOP vanilla pre-train on facts A (moc_facts), once per seed (sweep
           `retention_pretrain` of the config file); `python -m moc_jax.eval.background` then counts the
           MoC runs' chapter reads on A, the background sparse memory finetuning ranks against;
  phase 2  every arm of sweep `retention_finetune` continues from its kind's phase-1 weights of the same seed
           (`train.init_from`, fresh optimizer) on facts B: new entities, none of A's text;
  measure  on every phase-1 and phase-2 checkpoint, in this process: recall of A and of B on every probe
           (likelihood choice among 4 candidates, and greedy exact match) and CE on A's validation split.

Forgetting of an arm = (A recall before - A recall after) / (A recall before - chance): the share of what
phase 1 learnt above chance that phase 2 lost. Learning = B recall after - chance. DIR/retention.md and
DIR/retention.csv hold one row per arm (mean +- standard error over seeds) and DIR/retention.png plots
learning against forgetting. Like the sweeps (experiments/sweeps/launch.py) it is resumable and idempotent:
finished runs are skipped, interrupted ones resume, and the scores of a checkpoint are kept in its workdir.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

from absl import flags

from experiments import harness
from experiments.sweeps.launch import run_to_completion
from experiments.sweeps.plan import plan, resolve
from experiments.sweeps.report import mean_and_se
from moc_jax import cli, optim

FLAGS = flags.FLAGS


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  harness.define_flags("retention", "pretrain/, finetune/, the table and plot",
                       "retention_pretrain and retention_finetune define the arms")

# The quick size runs one point of each arm's sweep (its second rate; t = 4), for CI.
SIZES = {
    "default": {"seeds": (0, 1, 2), "pretrain": {"train.steps": 1800}, "finetune": {"train.steps": 16}},
    "quick": {"seeds": (0,), "shapes": {"data.seq_len": 32, "train.batch_size": 4, "train.eval_batches": 1,
                                        "data.facts.num_docs": 200, "data.facts.num_val_docs": 20},
              "pretrain": {"train.steps": 4, "train.warmup_steps": 1}, "finetune": {"train.steps": 3},
              "finetune_points": lambda o: (o.get("train.smf_top_t", 4) == 4
                                            and o.get("train.bank_lr", o.get("train.base_lr")) in (1e-4, 3.0))},
}
SCORES = "retention_scores.json"


def _phase(spec, sweep, size, extra, seeds, origin=None, keep=None):
  """The sweep's points at this size (steps, evaluation and checkpoint at the end only) for `seeds` (and `keep`'s
  overrides); with `origin` {(kind, seed): (phase-1 workdir, its cluster tree or None)}, each point starts from its
  kind's weights of its seed and reads new documents by the tree those weights learned by."""
  from moc_jax.config import validate
  steps = extra["train.steps"]
  every = {"train.eval_every": steps, "train.checkpoint_every": steps, "train.log_every": max(1, steps // 10)}
  if origin:  # planned (and validated) with some init_from, then each point given its own
    every["train.init_from"] = next(iter(origin.values()))[0]
  points = [p for p in plan(spec, sweep, base={**size.get("shapes", {}), **extra, **every})
            if p.config.seed in seeds and (keep is None or keep(p.overrides))]
  for p in points if origin else ():
    workdir, tree = origin[(_kind(p.config), p.config.seed)]
    p.overrides["train.init_from"] = workdir
    if tree:
      p.overrides["data.cluster.tree"] = tree
    p.config = resolve(spec, p.overrides)
    validate(p.config)
  return points


def _tree(config):
  """The cluster tree a phase-1 run read its documents by (its data's, cached), or None."""
  if not config.data.cluster.k:
    return None
  from moc_jax.data.cluster_paths import index_path
  from moc_jax.data.tokenizers import model_tokenizer
  return index_path(config.data, model_tokenizer(config))


def _kind(config) -> str:
  return "moc" if config.memory.enabled else "vanilla"


def family(config) -> str:
  """The arm a finetuning run belongs to, in words: the points of one family differ only in its sweep's knob."""
  t = config.train
  if not config.memory.enabled:
    return "dense, full finetuning"
  bank = optim.bank_update(t)
  frozen = t.base_lr == t.memory_lr == 0
  if bank.smf:
    rank = {"tfidf": "SMF (TF-IDF)", "tf": "SMF control: TF alone", "random": "SMF control: random chapters"}
    return f"MoC, {rank[bank.rank]}, {bank.step.upper() if bank.step == 'sgd' else 'AdamW'}" + (
        "" if frozen else ", the rest training")
  if bank.frozen:
    return "MoC, bank dropped from the optimizer"
  if frozen:
    return "MoC, the memory alone"
  return "MoC, full finetuning" if t.bank_lr in (None, t.memory_lr) else f"MoC, bank LR {t.bank_lr / t.memory_lr:g}x"


def knob(config) -> str:
  """The point of its family's sweep: the rate (the bank's where only the bank trains) and SMF's t."""
  t = config.train
  bank = optim.bank_update(t)
  lr = t.bank_lr if config.memory.enabled and t.base_lr == t.memory_lr == 0 else t.base_lr
  return f"t {bank.top_t}, lr {lr:g}" if bank.smf else f"lr {lr:g}"


def arm_label(config) -> str:
  return f"{family(config)} ({knob(config)})"


def _background(workdir):
  """The chapter reads of a MoC pre-training run on its own data (bank_background.json), once."""
  from moc_jax import bank_background
  if os.path.exists(os.path.join(workdir, bank_background.FILENAME)):
    return
  subprocess.run([sys.executable, "-m", "moc_jax.eval.background", f"--workdir={workdir}"], check=True)


def _facts(config, facts):
  """`config`'s data reading the corpus `facts` (a data.facts dict: phase 1's A, phase 2's B)."""
  data = config.data.copy_and_resolve_references()
  data.facts.update(facts)
  return data


def _probes(config, facts, tokenizer):
  """The probes of corpus `facts`, each with its prompt's path down the tree the run reads by (its
  data.cluster.tree, else the tree of its own training data) when its memory reads by cluster paths."""
  from moc_jax.config import reads_cluster_paths
  from moc_jax.data import load_probes
  from moc_jax.eval.probes import with_prompt_paths
  probes = load_probes(_facts(config, facts))
  if not reads_cluster_paths(config):
    return probes
  reader = config.copy_and_resolve_references()
  reader.data.cluster.tree = config.data.cluster.tree or _tree(config)
  return with_prompt_paths(reader, probes, tokenizer)


class _Scorer:
  """Recall of facts A and B and CE on A's validation split of checkpoints (`facts_a`, `facts_b`: the two
  corpora's data.facts), the evaluators built once per model shape (the phase-2 arms of a kind share them)."""

  def __init__(self, facts_a, facts_b):
    self.facts = {"A": facts_a, "B": facts_b}
    self.cache = {}

  def __call__(self, workdir) -> dict:
    path = os.path.join(workdir, SCORES)
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
    from moc_jax import sharding
    from moc_jax.data.tokenizers import model_tokenizer
    from moc_jax.eval.ce import CEEvaluator, split_batches
    from moc_jax.eval.probes import ProbeEvaluator
    from moc_jax.state import build_state, restore_params
    config = cli.run_config(workdir, {})
    mesh = sharding.make_mesh(config)
    with sharding.activate(mesh, sharding.rules_of(config)):
      layout = build_state(config, mesh)
      params, step = restore_params(workdir, layout)
      key = json.dumps({k: config[k].to_dict() for k in ("model", "memory", "data")}, sort_keys=True, default=str)
      if key not in self.cache:
        tokenizer = model_tokenizer(config)
        probes = {name: ProbeEvaluator(layout.graphdef, _probes(config, facts, tokenizer), tokenizer)
                  for name, facts in self.facts.items()}
        config_a = config.copy_and_resolve_references()
        config_a.data = _facts(config, self.facts["A"])
        ce = CEEvaluator(layout.graphdef, layout.shardings["params"], sharding.data_sharding(config, mesh),
                         split_batches(config_a, "validation"))
        self.cache[key] = probes, ce
      probes, ce = self.cache[key]
      scores = {"workdir": workdir, "step": step, "ce_A": ce(params)["ce"]}
      for name, evaluator in probes.items():
        out = evaluator(params)
        scores.update({f"recall_{name}": out["probe_acc"], f"exact_{name}": out["probe_exact"],
                       f"probes_{name}": out["num_probes"], "chance": out["probe_chance"]})
    with open(path + ".tmp", "w") as f:
      json.dump(scores, f, indent=1)
    os.replace(path + ".tmp", path)
    return scores


def forgetting(before, after, chance) -> float:
  """The share of phase 1's recall above chance that phase 2 lost (NaN when phase 1 learnt nothing)."""
  return (before - after) / (before - chance) if before > chance else float("nan")


def pareto_front(points) -> list[tuple[float, float]]:
  """(learning, forgetting) points of one family's sweep -> its front: the points no other point beats on both
  (more learning and less forgetting), in order of learning. NaN points are dropped."""
  front = []
  for learn, forget in sorted((p for p in points if not any(map(math.isnan, p))), key=lambda p: (-p[0], p[1])):
    if not front or forget < front[-1][1]:
      front.append((learn, forget))
  return front[::-1]


def forgetting_at(points, learning, tolerance=0.1) -> float | None:
  """The forgetting a family's sweep reaches at `learning` (matched learning): linear along its `pareto_front`
  between the two front points whose learning brackets it; the least forgetting of its points that learn at least
  (1 - tolerance) x `learning` when its front ends below `learning`; None when none of them does (the family cannot
  learn that much)."""
  front = pareto_front(points)
  for (l0, f0), (l1, f1) in zip(front, front[1:]):
    if l0 <= learning <= l1:
      return f0 + (f1 - f0) * (learning - l0) / (l1 - l0) if l1 > l0 else min(f0, f1)
  close = [f for l, f in front if l >= (1 - tolerance) * learning]
  return min(close) if close else None


FULL_FINETUNING = "MoC, full finetuning"  # the family whose best learning of B the others are matched to


def matched(summary, reference=FULL_FINETUNING) -> str:
  """Markdown: the reference family's best mean learning of B, and each family's forgetting there (`forgetting_at`
  over its points' means), or that it does not learn as much."""
  families = {}
  for r in summary:
    families.setdefault(r["family"], []).append((r["learning"], r["forgetting"]))
  if reference not in families:
    return ""
  level = max(learn for learn, _ in families[reference])
  lines = [f"At matched learning of B ({reference}'s best: {level:.3f} above chance; within 10%):", ""]
  for name, points in families.items():
    if all(math.isnan(f) for _, f in points):
      lines.append(f"- {name}: forgetting undefined (phase 1 left A at chance)")
      continue
    f = forgetting_at(points, level)
    lines.append(f"- {name}: " + ("does not learn as much" if f is None else f"forgetting {f:.3f}"))
  return "\n".join(lines)


def summarise(rows) -> list[dict]:
  """rows: one per finetuning run {arm, seed, before: scores, after: scores} -> one per arm, mean and SE."""
  arms = {}
  for r in rows:
    arms.setdefault((r.get("family", r["arm"]), r["arm"]), []).append(r)
  out = []
  for (name, arm), runs in arms.items():
    chance = runs[0]["after"]["chance"]
    per_run = {
        "A_before": [r["before"]["recall_A"] for r in runs], "A_after": [r["after"]["recall_A"] for r in runs],
        "B_after": [r["after"]["recall_B"] for r in runs], "exact_A_after": [r["after"]["exact_A"] for r in runs],
        "exact_B_after": [r["after"]["exact_B"] for r in runs], "ce_A_after": [r["after"]["ce_A"] for r in runs],
        "forgetting": [forgetting(r["before"]["recall_A"], r["after"]["recall_A"], chance) for r in runs],
        "learning": [r["after"]["recall_B"] - chance for r in runs]}
    row = {"family": name, "arm": arm, "seeds": len(runs), "per_run": per_run}
    for k, v in per_run.items():
      row[k], row[k + "_se"] = mean_and_se(v)
    out.append(row)
  return out


COLUMNS = (("A_before", "A recall before"), ("A_after", "A recall after"), ("forgetting", "forgetting of A"),
           ("B_after", "B recall after"), ("learning", "learning of B"), ("exact_A_after", "A exact after"),
           ("exact_B_after", "B exact after"), ("ce_A_after", "CE on A after"))


def markdown(summary) -> str:
  head = "| arm | seeds | " + " | ".join(name for _, name in COLUMNS) + " |"
  lines = [head, "|---|---:|" + "---:|" * len(COLUMNS)]
  for r in summary:
    cells = [f"{r[k]:.3f} ± {r[k + '_se']:.3f}" for k, _ in COLUMNS]
    lines.append(f"| {r['arm']} | {r['seeds']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_csv(summary, path):
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, ["family", "arm", "seeds"] + [x for k, _ in COLUMNS for x in (k, k + "_se")],
                            extrasaction="ignore")
    writer.writeheader()
    writer.writerows(summary)


def plot(summary, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  families = {}
  for r in summary:
    families.setdefault(r["family"], []).append(r)
  for name, points in families.items():  # a family's sweep, its points in order of learning
    points = sorted(points, key=lambda r: r["learning"])
    ax.errorbar([r["learning"] for r in points], [r["forgetting"] for r in points],
                xerr=[r["learning_se"] for r in points], yerr=[r["forgetting_se"] for r in points], fmt="o-",
                capsize=3, label=name)
  ax.axhline(0, color="grey", lw=0.5)
  ax.set_xlabel("learning of B: B recall after phase 2 - chance")
  ax.set_ylabel("forgetting of A: share of A's recall above chance lost")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(out, spec, quick, parallel) -> list[dict]:
  size = SIZES["quick" if quick else "default"]
  seeds = size["seeds"]
  out = os.path.abspath(out)
  pre_dir, fine_dir = os.path.join(out, "pretrain"), os.path.join(out, "finetune")
  pretrain = _phase(spec, "retention_pretrain", size, size["pretrain"], seeds)
  run_to_completion(pre_dir, spec, "retention_pretrain", pretrain, parallel, "retention")
  origin = {(_kind(p.config), p.config.seed): (os.path.join(pre_dir, p.name), _tree(p.config)) for p in pretrain}
  for (kind, _), (workdir, _) in origin.items():
    if kind == "moc":
      _background(workdir)
  finetune = _phase(spec, "retention_finetune", size, size["finetune"], seeds, origin, size.get("finetune_points"))
  run_to_completion(fine_dir, spec, "retention_finetune", finetune, parallel, "retention")
  scorer = _Scorer(pretrain[0].config.data.facts.to_dict(), finetune[0].config.data.facts.to_dict())
  rows = [{"family": family(p.config), "arm": arm_label(p.config), "seed": p.config.seed,
           "before": scorer(origin[(_kind(p.config), p.config.seed)][0]),
           "after": scorer(os.path.join(fine_dir, p.name))} for p in finetune]
  summary = summarise(rows)
  with open(os.path.join(out, "retention.md"), "w") as f:
    f.write(markdown(summary) + "\n\n" + matched(summary) + "\n")
  write_csv(summary, os.path.join(out, "retention.csv"))
  with open(os.path.join(out, "retention_runs.json"), "w") as f:
    json.dump(rows, f, indent=1)
  plot(summary, os.path.join(out, "retention.png"))
  return summary


def main(argv):
  cli.begin(argv)
  harness.check_parallel(FLAGS.parallel)
  summary = run(FLAGS.out, FLAGS.config, FLAGS.quick, FLAGS.parallel)
  print(markdown(summary))
  print(f"\n{FLAGS.out}/retention.md, retention.csv, retention.png")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
