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
from experiments.sweeps.report import mean_and_se, welch_t
from moc_jax import cli, optim

FLAGS = flags.FLAGS


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  harness.define_flags("retention", "pretrain/, finetune/, the table and plot",
                       "retention_pretrain and retention_finetune define the arms")

# The quick size runs one point of each arm's sweep (its second rate; t = 4), for CI.
SIZES = {
    # phase 1: 900 steps; at step 900 of a 1,800-step run FFN memory knew A (0.976) and held 47% of it
    # (docs/results/2026-11-28-retention-phase1-ffn.md)
    "default": {"seeds": (0, 1, 2), "pretrain": {"train.steps": 900}, "finetune": {"train.steps": 16},
                "format": {"train.steps": 100}},
    "quick": {"seeds": (0,), "shapes": {"data.seq_len": 32, "train.batch_size": 4, "train.eval_batches": 1,
                                        "data.facts.num_docs": 200, "data.facts.num_val_docs": 20},
              "pretrain": {"train.steps": 4, "train.warmup_steps": 1}, "finetune": {"train.steps": 3},
              "format": {"train.steps": 3, "data.seq_len": 96},  # a chat row whole: its answer is what is learnt
              "finetune_points": lambda o: (o.get("train.smf_top_t", 4) == 4
                                            and o.get("train.bank_lr", o.get("train.base_lr")) in (1e-4, 3.0))},
}
SCORES = "retention_scores.json"
# Phase 1 must know A and have its memory hold a share of it, or no arm's retention can be told apart.
PHASE1_RECALL, PHASE1_HELD = 0.9, 0.3


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
  if config.data.name.startswith("chat:"):
    return FORMAT_SHIFT + _format_arm(config)
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


FORMAT_SHIFT = "chat-format shift: "  # the paper's arm's families


def _format_arm(config) -> str:
  t = config.train
  if not config.memory.enabled:
    return "dense"
  if t.freeze_bank:
    return "MoC, bank frozen"
  if t.bank_lr in (None, t.memory_lr):
    return "MoC, bank at the same rate"
  return f"MoC, bank at {t.bank_lr / t.memory_lr:g}x"


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
  data.name = "moc_facts"  # the format shift's runs read chat files
  data.facts.update(facts)
  return data


def chat_rows(probes) -> list[dict]:
  """Chat rows (`data.name=chat:`) asking each probe's fact: the prompt as the user's turn, the answer as the
  assistant's."""
  return [{"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["answer"]}]}
          for p in probes]


def write_chat(directory, config, facts_a, facts_b) -> str:
  """The format shift's data: B's facts asked in chat rows to train on, A's for its validation split (the format on
  facts phase 1 knew); returns the data.name reading them."""
  from moc_jax.data import load_probes
  os.makedirs(directory, exist_ok=True)
  for split, facts in (("train", facts_b), ("validation", facts_a)):
    path = os.path.join(directory, f"chat_{split}.jsonl")
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in chat_rows(load_probes(_facts(config, facts))))
    os.replace(path + ".tmp", path)
  return "chat:" + os.path.join(directory, "chat_{split}.jsonl")


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
  """Recall of facts A and B and CE on A's validation split of checkpoints (`data_a`: phase 1's data config, `facts_b`:
  B's data.facts), the evaluators built once per model shape (the phase-2 arms of a kind share them)."""

  def __init__(self, data_a, facts_b):
    self.data_a = data_a
    self.facts = {"A": data_a.facts.to_dict(), "B": facts_b}
    self.cache = {}

  def _a_split(self, config):
    """A's validation text as phase 1 read it (its layout and row length: phase 2's stream and chat rows are cut
    otherwise, and a CE rise must compare like with like), by the run's own cluster tree (none for dense)."""
    data = self.data_a.copy_and_resolve_references()
    data.cluster = config.data.cluster.copy_and_resolve_references()
    return data

  def __call__(self, workdir) -> dict:
    path = os.path.join(workdir, SCORES)
    if os.path.exists(path):
      with open(path) as f:
        scores = json.load(f)
      if "held_A" in scores:  # scores written before the knock-out was measured are measured again
        return scores
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
        config_a.data = self._a_split(config)
        ce = CEEvaluator(layout.graphdef, layout.shardings["params"], sharding.data_sharding(config, mesh),
                         split_batches(config_a, "validation"))
        self.cache[key] = probes, ce
      probes, ce = self.cache[key]
      scores = {"workdir": workdir, "step": step, "ce_A": ce(params)["ce"]}
      for name, evaluator in probes.items():
        out = evaluator(params)
        scores.update({f"recall_{name}": out["probe_acc"], f"exact_{name}": out["probe_exact"],
                       f"probes_{name}": out["num_probes"], "chance": out["probe_chance"]})
      scores.update(_knock_out(config, params, probes["A"], scores))
    with open(path + ".tmp", "w") as f:
      json.dump(scores, f, indent=1)
    os.replace(path + ".tmp", path)
    return scores


def _knock_out(config, params, probes_a, scores) -> dict:
  """Recall of A with the memory knocked out (every routable chapter, column or slot zeroed: `python -m moc_jax.eval
  --ablate_chapters=routed`) and `held_A`, the share of the recall above chance that this removes (NaN without memory
  or above-chance recall): how much of A the memory holds."""
  if not config.memory.enabled:
    return {"knocked_A": math.nan, "held_A": math.nan}
  from moc_jax.eval import routing as ra
  mask = ra.ablation_mask(("routed", None), ra.Usage(config))
  knocked = probes_a(ra.zero_chapters(params, mask))["probe_acc"]
  return {"knocked_A": knocked, "held_A": forgetting(scores["recall_A"], knocked, scores["chance"])}


def phase1_verdict(scores) -> dict:
  """Phase 1's MoC runs' scores (one per seed) -> {recall, held (means), met, text}: whether phase 1 knows A
  (recall ≥ PHASE1_RECALL) with a memory that holds a share of it (held ≥ PHASE1_HELD) worth protecting."""
  recall, recall_se = mean_and_se([s["recall_A"] for s in scores])
  held, held_se = mean_and_se([s["held_A"] for s in scores])
  met = recall >= PHASE1_RECALL and held >= PHASE1_HELD
  why = ("phase 1 does not know A well enough for its forgetting to show" if recall < PHASE1_RECALL else
         "the memory holds too little of A for its protection to show")
  text = (f"Phase 1 (MoC, {len(scores)} seeds): recall of A {recall:.3f} ± {recall_se:.3f} "
          f"(needs ≥ {PHASE1_RECALL:g}); knocking the memory out removes {held:.0%} ± {held_se:.0%} of it above "
          f"chance (needs ≥ {PHASE1_HELD:.0%}): " + ("**met**" if met else f"**not met**: {why}"))
  return {"recall": recall, "held": held, "met": met, "text": text}


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


def format_verdict(rows) -> str:
  """Markdown: the paper's arm (the chat-format shift), each family's forgetting of A and rise of CE on A's text
  (mean ± standard error over seeds), and each MoC family against the dense model: Welch's t of forgetting (dense
  minus MoC: positive when MoC forgets less)."""
  families = {}
  for r in rows:
    if r["family"].startswith(FORMAT_SHIFT):
      chance = r["after"]["chance"]
      forgot = forgetting(r["before"]["recall_A"], r["after"]["recall_A"], chance)
      families.setdefault(r["family"][len(FORMAT_SHIFT):], []).append((forgot, r["after"]["ce_A"] - r["before"]["ce_A"]))
  if not families:
    return ""
  lines = ["The paper's arm, a chat-format shift at a tenth of the pre-training rate:", "",
           "| arm | seeds | forgetting of A | CE on A's text, rise | against dense: Welch's t of forgetting |",
           "|---|---:|---:|---:|---:|"]
  dense = [f for f, _ in families.get("dense", [])]
  for name, runs in families.items():
    forgot, rise = zip(*runs)
    (f, f_se), (c, c_se) = mean_and_se(forgot), mean_and_se(rise)
    t = f"{welch_t(dense, forgot)[0]:+.2f}" if name != "dense" and len(dense) > 1 and len(runs) > 1 else ""
    lines.append(f"| {name} | {len(runs)} | {f:.3f} ± {f_se:.3f} | {c:+.4f} ± {c_se:.4f} | {t} |")
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
  pre_dir, fine_dir, format_dir = (os.path.join(out, name) for name in ("pretrain", "finetune", "format"))
  pretrain = _phase(spec, "retention_pretrain", size, size["pretrain"], seeds)
  run_to_completion(pre_dir, spec, "retention_pretrain", pretrain, parallel, "retention")
  origin = {(_kind(p.config), p.config.seed): (os.path.join(pre_dir, p.name), _tree(p.config)) for p in pretrain}
  for (kind, _), (workdir, _) in origin.items():
    if kind == "moc":
      _background(workdir)
  finetune = _phase(spec, "retention_finetune", size, size["finetune"], seeds, origin, size.get("finetune_points"))
  run_to_completion(fine_dir, spec, "retention_finetune", finetune, parallel, "retention")
  facts_a, facts_b = pretrain[0].config.data.facts.to_dict(), finetune[0].config.data.facts.to_dict()
  chat = write_chat(os.path.join(format_dir, "chat"), pretrain[0].config, facts_a, facts_b)
  shift = _phase(spec, "retention_format", size, {**size["format"], "data.name": chat}, seeds, origin)
  run_to_completion(format_dir, spec, "retention_format", shift, parallel, "retention")
  scorer = _Scorer(pretrain[0].config.data, facts_b)
  rows = [{"family": family(p.config), "arm": arm_label(p.config), "seed": p.config.seed,
           "before": scorer(origin[(_kind(p.config), p.config.seed)][0]),
           "after": scorer(os.path.join(directory, p.name))}
          for directory, points in ((fine_dir, finetune), (format_dir, shift)) for p in points]
  summary = summarise(rows)
  phase1 = phase1_verdict([scorer(workdir) for (kind, _), (workdir, _) in origin.items() if kind == "moc"])
  stream = [r for r in summary if not r["family"].startswith(FORMAT_SHIFT)]
  with open(os.path.join(out, "retention.md"), "w") as f:
    f.write("\n\n".join([phase1["text"], markdown(stream), matched(stream), format_verdict(rows)]) + "\n")
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
