"""`python -m experiments.routing_evidence --out=DIR [--quick] [--parallel=2] [--moc=POINT]
[--stages=arms,bank,budget] [--only=POINT,...] [--config=configs/moc.py:tiny]`

Does the memory pay, and under which router? The evidence of docs/routing.md in one command, three stages,
each a sweep of the config file run to completion in DIR/<stage>/ (resumable and idempotent like
launch/sweep.py: finished runs are skipped, interrupted ones resume):

  arms    sweep `routing` at half the config's steps: the backbone without memory, its iso-FLOP vanilla, and
          MoC under every load balance x routing, and `routed` + `prefix` with attention pooling;
  bank    sweep `bank_seeds` under the chosen MoC arm, at the same steps: banks from one read (shared + top-k
          chapters) to the config's bank, every one read at the same top-k;
  budget  sweep `budget` under the chosen MoC arm: MoC and its iso-FLOP vanilla at 1/2, 1 and 2x the steps.

Every point runs once per seed. The chosen arm is the causal MoC arm of `arms` with the highest mean fact
recall, the goal's metric (lower validation CE breaks a tie); --moc names any arm instead. Each MoC run is then
evaluated by `python -m moc_jax.eval` (chapters read over the validation split, max / mean load, the overlap of
fact prompts' chapters with a paraphrase's and with another entity's), and once more with every routable chapter
zeroed: the recall the bank holds; each vanilla run once, for its recall by the entity's training documents.
DIR/<stage>/results.md holds a stage's tables (moc_jax/report.py); DIR/evidence.md the chosen arm, the
three tables across seeds, each goal of the routing work, met or not, with its numbers, and the budget stage's
recall by the entity's training documents.

--stages runs some of the stages (the default size takes hours on a CPU: split it over invocations or machines
sharing DIR). A stage left out is not run but still reported from what DIR holds of it, so evidence.md always
covers the whole directory; without stage `arms` in DIR, --moc names the arm. --only narrows the stages run to
the points it names (e.g. one budget of stage `budget`).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import time

from absl import flags

from experiments import harness
from experiments.evaluation import EVAL_TIME, eval_seconds, evaluate_runs
from experiments.sweeps import report
from experiments.sweeps.launch import run_to_completion
from experiments.sweeps.plan import is_moc, plan, resolve, same_run
from experiments.sweeps.runs import MANIFEST, finished, read_manifest
from moc_jax import cli

FLAGS = flags.FLAGS

STAGES = ("arms", "bank", "budget")
SWEEP_OF = {"arms": "routing", "bank": "bank_seeds", "budget": "budget"}
# what an arm of `arms` sets
ARM_KEYS = ("memory.load_balance", "memory.load_balance_coef", "memory.routing", "memory.routing_pool")
# The default size is what docs/routing.md measured; quick tests the harness in a few minutes (CI).
SIZES = {
    "default": {"seeds": (0, 1, 2), "shapes": {"train.num_probes": 4096}},
    "quick": {"seeds": (0,),
              "shapes": {"train.steps": 4, "train.warmup_steps": 1, "data.seq_len": 32, "train.batch_size": 4,
                         "train.eval_batches": 1, "train.num_probes": 16, "data.facts.num_docs": 200,
                         "data.facts.num_val_docs": 20, "train.log_every": 1}},
}
ARMS_STEPS = 0.5  # stages arms and bank train for this share of the config's steps (budget's shortest point)
GOAL_Z = 2.0  # MoC's recall must beat the iso-FLOP vanilla's by this many combined standard errors
GOAL_READ, GOAL_LOAD = 0.9, 3.0  # chapters read over an evaluation, max / mean load
REUSED = "reused.json"  # in a run's workdir: the earlier stage's identical run it was copied from


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  harness.define_flags("routing_evidence", "arms/, bank/, budget/, evidence.md",
                       "routing, bank_seeds and budget define the runs")
  flags.DEFINE_string("moc", None, "The MoC arm of stage `arms` that stages bank and budget use, by point name "
                      "(e.g. routed-prefix); default: the causal arm with the highest mean fact recall.")
  flags.DEFINE_list("stages", list(STAGES), "The stages to run, of arms, bank, budget; the others are reported from "
                    "what DIR holds of them.")
  flags.DEFINE_list("only", None, "Run only these points of the stages run, by run name (e.g. steps900-seed0); "
                    "default: all.")


# ---- running --------------------------------------------------------------------------------------------

def _plan(spec, stage, size, arm=None):
  """The stage's points at this size for its seeds: the final evaluation scores every seen fact (the size's
  num_probes), checkpoints as the config has them (a run stopped midway resumes)."""
  steps = size["shapes"].get("train.steps") or resolve(spec, {}).train.steps
  half = max(1, int(steps * ARMS_STEPS))
  extra = {**{k: v for k, v in size["shapes"].items() if k != "train.steps"}, **(arm or {})}
  if stage == "budget":  # the sweep scales the steps itself; the last evaluation comes at each run's end
    points = plan(spec, SWEEP_OF[stage], {**extra, "train.eval_every": 2 * steps}, base={"train.steps": steps})
  else:
    points = plan(spec, SWEEP_OF[stage], {**extra, "train.steps": half, "train.eval_every": half})
  return [p for p in points if p.config.seed in size["seeds"]]


def _groups(stage_dir) -> list[dict]:
  """The stage's points across seeds (report.seed_groups), each with its overrides (without the seed)."""
  rows = report.run_rows(stage_dir)
  overrides = {re.sub(r"-seed\d+$", "", r["run"]): r["overrides"] for r in rows}
  return [{**g, "overrides": overrides[g["point"]]} for g in report.seed_groups(rows)]


def stage_results(out, spec, stage, size, parallel, arm=None, run=True, earlier=(), only=None) -> dict | None:
  """One stage: trained and evaluated when `run` (a point that is the same run as one of `earlier`, the
  finished (config, workdir) pairs of the stages before it, is copied from it, not trained again), otherwise
  read from what DIR holds of it (None: nothing). Returns {groups, wall_s, eval_s, run, done, points, reused,
  finished}: the runs' and the evaluations' own wall times, each summed over the stage and over every
  invocation that worked on it; of the plan's points, how many finished and how many are copies; the finished
  (config, workdir) pairs. `only`: the names of the points to run (default all)."""
  stage_dir = os.path.join(out, stage)
  if not run and not os.path.exists(os.path.join(stage_dir, MANIFEST)):
    return None
  points = _plan(spec, stage, size, arm)
  workdirs = [os.path.join(stage_dir, p.name) for p in points]
  if run:
    todo = [p for p in points if only is None or p.name in only]
    dirs = [os.path.join(stage_dir, p.name) for p in todo]
    _reuse(todo, dirs, earlier)
    run_to_completion(stage_dir, spec, SWEEP_OF[stage], todo, parallel, "routing_evidence")
    evaluate_runs([(w, is_moc(p.config)) for p, w in zip(todo, dirs)], parallel, "routing_evidence")
  report.collect(stage_dir)
  wall = sum(e.get("wall_s", 0.0) for e in read_manifest(stage_dir) if e["name"] in {p.name for p in points})
  done = [(p.config, w) for w, p in zip(workdirs, points) if finished(w, p.config.train.steps)]
  return {"groups": _groups(stage_dir), "wall_s": wall, "eval_s": sum(map(eval_seconds, workdirs)), "run": run,
          "done": len(done), "points": len(points), "finished": done,
          "reused": sum(os.path.exists(os.path.join(w, REUSED)) for w in workdirs)}


def _reuse(points, workdirs, earlier) -> None:
  """Copies into each point's new workdir an earlier stage's finished run that is the same run
  (same_run): the stages share points (the chosen arm at the steps of `arms` is also the config's bank
  in `bank` and the shortest budget in `budget`, as is its vanilla), and training one again only gives the same
  losses. Its evaluation comes along; the time it took does not (this stage spent none on it)."""
  import shutil
  for point, workdir in zip(points, workdirs):
    source = None if os.path.exists(workdir) else next(
        (w for config, w in earlier if same_run(point.config, config)), None)
    if source is None:
      continue
    shutil.rmtree(workdir + ".partial", ignore_errors=True)  # what a copy cut short left
    shutil.copytree(source, workdir + ".partial", ignore=shutil.ignore_patterns(EVAL_TIME, ".lock"))
    with open(os.path.join(workdir + ".partial", REUSED), "w") as f:
      json.dump({"from": source}, f)
    os.rename(workdir + ".partial", workdir)  # a copy cut short never looks like a run
    print(f"routing_evidence: {workdir} is the same run as {source}: copied, not trained again", flush=True)


# ---- the evidence ---------------------------------------------------------------------------------------

def is_causal(group) -> bool:
  from moc_jax.config.schema import CAUSAL_ROUTINGS
  return group["overrides"].get("memory.routing") in CAUSAL_ROUTINGS


def choose_arm(groups, name=None) -> dict:
  """The MoC group named `name`, or the causal one with the highest mean fact recall (then the lowest CE).
  Only causal arms are chosen by default: a non-causal arm's validation CE counts what its routing saw of
  the tokens it predicts (docs/routing.md measures how much), so against a vanilla it is not a fair score."""
  from moc_jax.errors import UsageError
  moc = [g for g in groups if g["kind"] == "moc"]
  if name is not None:
    named = [g for g in moc if g["point"] == name]
    if not named:
      raise UsageError(f"--moc={name}: no such MoC arm; the arms are {sorted(g['point'] for g in moc)}")
    return named[0]
  causal = [g for g in moc if is_causal(g)]
  if not causal:
    raise UsageError(f"no causal MoC arm to choose from ({sorted(g['point'] for g in moc)}); name one with --moc")
  return max(causal, key=lambda g: (g.get("fact_recall", -math.inf), -g.get("val_ce", math.inf)))


def named_arm(spec, name) -> dict:
  """The MoC arm `name` of the `routing` sweep, from its plan (nothing trained): how stages bank and budget
  run without stage `arms` in DIR."""
  from moc_jax.errors import UsageError
  if name is None:
    raise UsageError("--stages: stage arms is neither run nor in --out, so nothing chooses the MoC arm; name it "
                     "with --moc (e.g. --moc=routed-prefix)")
  arms = {re.sub(r"-seed\d+$", "", p.name): p for p in plan(spec, SWEEP_OF["arms"]) if is_moc(p.config)}
  if name not in arms:
    raise UsageError(f"--moc={name}: no such MoC arm; the arms are {sorted(arms)}")
  return {"point": name, "kind": "moc", "overrides": arms[name].overrides}


def arm_overrides(group) -> dict:
  return {k: v for k, v in group["overrides"].items() if k in ARM_KEYS}


def z_gap(a, a_se, b, b_se) -> float:
  """(a - b) in combined standard errors, sqrt(a_se² + b_se²); NaN when there is no spread (one seed)."""
  spread = math.hypot(a_se, b_se)
  return (a - b) / spread if spread > 0 else math.nan


def goals(chosen, bank_groups, budget_groups) -> list[dict]:
  """Each goal of the routing work that DIR's stages can judge: {goal, met, detail}. `chosen` (the arm's group
  in stage `arms`), `bank_groups` and `budget_groups` are None when their stage is not in DIR."""
  out = []
  if chosen is not None:
    read, load = chosen.get("eval_used_frac", math.nan), chosen.get("eval_max_load", math.nan)
    out.append({"goal": f"≥ {GOAL_READ:.0%} of routable chapters read over the validation split, max / mean load "
                        f"≤ {GOAL_LOAD:g}", "met": read >= GOAL_READ and load <= GOAL_LOAD,
                "detail": f"{chosen['point']}: {read:.3f} read, max / mean load {load:.2f}"})
    para, other = chosen.get("paraphrase_jaccard", math.nan), chosen.get("other_entity_jaccard", math.nan)
    out.append({"goal": "routing follows the entity: a paraphrase's chapters overlap more than another entity's",
                "met": para > other, "detail": f"{chosen['point']}: Jaccard {para:.3f} paraphrase vs {other:.3f} "
                                               "other entity"})
  if budget_groups is not None:
    out.append(_beats_vanilla(budget_groups))
  if bank_groups is not None:
    out.append(_bank_monotone(bank_groups))
  return out


def _beats_vanilla(budget_groups) -> dict:
  by_steps = {}
  for g in budget_groups:
    by_steps.setdefault(g["overrides"]["train.steps"], {})[g["kind"]] = g
  details, wins = [], 0
  for steps, pair in sorted(by_steps.items()):
    if {"moc", "dense"} <= set(pair):
      m, d = pair["moc"], pair["dense"]
      z = z_gap(m["fact_recall"], m["fact_recall_se"], d["fact_recall"], d["fact_recall_se"])
      wins += z >= GOAL_Z
      gap = "one seed: no standard error" if math.isnan(z) else f"{z:+.1f} SE"
      details.append(f"{steps} steps: {m['fact_recall']:.3f} vs {d['fact_recall']:.3f} ({gap})")
  return {"goal": f"MoC's fact recall beats the iso-FLOP vanilla's by ≥ {GOAL_Z:g} standard errors at equal "
                  "training FLOPs", "met": wins > 0,
          "detail": f"met at {wins} of {len(details)} budgets; " + "; ".join(details)}


def _bank_monotone(bank_groups) -> dict:
  sizes = sorted((g["overrides"]["memory.num_tokens"], g) for g in bank_groups if g["kind"] == "moc")
  ce = [g["val_ce"] for _, g in sizes]
  recall = [g["fact_recall"] for _, g in sizes]
  monotone = (len(sizes) >= 4 and all(a > b for a, b in itertools.pairwise(ce))
              and all(a < b for a, b in itertools.pairwise(recall)))
  return {"goal": "validation CE falls and fact recall rises at every step over ≥ 4 bank sizes at a fixed read",
          "met": monotone, "detail": "; ".join(f"{n:,} tokens: CE {c:.4f}, recall {r:.3f}"
                                               for (n, _), c, r in zip(sizes, ce, recall))}


def held_by_bank(budget_groups) -> list[str]:
  """Where MoC's recall lives: its recall at each budget against the same runs' with every routable chapter zeroed."""
  rows = sorted((g["overrides"]["train.steps"], g) for g in budget_groups
                if g["kind"] == "moc" and "recall_without_bank" in g)
  if not rows:
    return []
  cell = lambda g, k: f"{g[k]:.3f}" + ("" if math.isnan(g[k + "_se"]) else f" ± {g[k + '_se']:.3f}")
  return ["Where MoC's recall lives (`python -m moc_jax.eval --ablate_chapters=routed`: every routable chapter "
          "zeroed):", "", "| steps | fact recall | without the bank | held by the bank |", "|---:|---:|---:|---:|",
          *(f"| {steps} | {cell(g, 'fact_recall')} | {cell(g, 'recall_without_bank')} | "
            f"{g['fact_recall'] - g['recall_without_bank']:+.3f} |" for steps, g in rows), ""]


def markdown(spec, size_name, stages, chosen, goal_list, machine) -> str:
  """evidence.md: each stage DIR holds (one not run by this invocation says how many of its runs finished),
  the arm, the goals its stages can judge and the wall time."""
  flag = " --quick" if size_name == "quick" else ""
  lines = [f"# Routing evidence: `python -m experiments.routing_evidence --config={spec}{flag}`", "",
           (f"Size `{size_name}`; {machine}. Mean ± standard error over seeds; fact recall on the final evaluation's "
            "probes (likelihood choice among 4 candidates), chapters read and load over the validation split "
            "(`python -m moc_jax.eval`)."), ""]
  titles = {"arms": "Stage `arms`: every load balance x routing, the backbone and its iso-FLOP vanilla",
            "bank": f"Stage `bank`: bank sizes at a fixed read, under {chosen['point']}",
            "budget": f"Stage `budget`: MoC ({chosen['point']}) and its iso-FLOP vanilla at three budgets"}
  for stage in STAGES:
    if stage in stages:
      s = stages[stage]
      found = ([f"Not run by this invocation: {s['done']} of its {s['points']} runs have finished in {stage}/.", ""]
               if not s.get("run", True) else
               [f"{s['done']} of its {s['points']} runs have finished (--only left the others out).", ""]
               if s.get("done", 0) < s.get("points", 0) else [])
      if s.get("reused"):
        copies = "is a copy" if s["reused"] == 1 else "are copies"
        found += [f"{s['reused']} of its runs {copies} of an earlier stage's identical run ({REUSED} in the run's "
                  "directory names it), not trained again.", ""]
      lines += [f"## {titles[stage]}", "", *found, *report.seed_table(s["groups"]), "",
                f"Runs {s['wall_s']:,.0f} s, evaluations {s['eval_s']:,.0f} s (each one's own wall time, summed over the "
                f"stage and every invocation; runs side by side overlap); per run: {stage}/results.md.",
                ""]
      if stage == "arms":
        causal = "causal" if is_causal(chosen) else "NOT causal: its CE counts what routing saw of later tokens"
        lines += [f"Chosen MoC arm: **{chosen['point']}** ({arm_overrides(chosen)}; {causal}).", ""]
  if "arms" not in stages:
    lines += [f"MoC arm: **{chosen['point']}** (--moc; {arm_overrides(chosen)}).", ""]
  lines += ["## Goals", "", "| goal | met | numbers |", "|---|---|---|"]
  lines += [f"| {g['goal']} | {'yes' if g['met'] else '**no**'} | {g['detail']} |" for g in goal_list]
  missing = [stage for stage in STAGES if stage not in stages]
  if missing:
    lines += ["", f"Not judged: the goals of stage(s) {', '.join(missing)}, which the directory does not hold."]
  budget = stages.get("budget", {}).get("groups", [])
  lines += ["", *held_by_bank(budget)]
  by_docs = report.recall_by_docs_table(budget)
  if by_docs:
    lines += ["Fact recall by how many training documents name the entity, stage `budget` (`python -m "
              "moc_jax.eval`; the rarest entities are where a memory should pay first):", "", *by_docs, ""]
  total = sum(s["wall_s"] + s["eval_s"] for s in stages.values())
  return "\n".join(lines + ["", f"Wall time of the runs and evaluations, summed: {total:,.0f} s.", ""])


def run(out, spec, quick, parallel, moc=None, stages=STAGES, only=None) -> str:
  """Runs `stages` (their points named in `only`, default all) and writes DIR/evidence.md over every stage DIR
  holds; returns its text."""
  from moc_jax.errors import UsageError
  from moc_jax.train.peaks import cpu_model
  unknown = sorted(set(stages) - set(STAGES))
  if unknown or not stages:
    raise UsageError(f"--stages={','.join(stages)}: name one or more of {', '.join(STAGES)}")
  size_name = "quick" if quick else "default"
  size, out = SIZES[size_name], os.path.abspath(out)
  if only is not None:  # point names do not depend on the arm
    names = {p.name for stage in stages for p in _plan(spec, stage, size)}
    if set(only) - names:
      raise UsageError(f"--only: no points {sorted(set(only) - names)} in stage(s) {','.join(stages)}; they have "
                       f"{sorted(names)}")
  results = {}
  arms = stage_results(out, spec, "arms", size, parallel, run="arms" in stages, only=only)
  earlier = list((arms or {}).get("finished", []))
  if arms is not None:
    results["arms"] = arms
  found = [g for g in (arms or {}).get("groups", []) if g["kind"] == "moc"]
  in_arms = bool(found) and (moc is None or any(g["point"] == moc for g in found))
  chosen = choose_arm(found, moc) if in_arms else named_arm(spec, moc)
  for stage in ("bank", "budget"):
    result = stage_results(out, spec, stage, size, parallel, arm_overrides(chosen), stage in stages, earlier, only)
    if result is not None:
      results[stage] = result
      earlier += result["finished"]
  machine = f"{os.cpu_count()} cores of {cpu_model()}, {time.strftime('%Y-%m-%d')}"
  judged = goals(chosen if in_arms else None,
                 results.get("bank", {}).get("groups"), results.get("budget", {}).get("groups"))
  text = markdown(spec, size_name, results, chosen, judged, machine)
  with open(os.path.join(out, "evidence.md"), "w") as f:
    f.write(text)
  return text


def main(argv):
  cli.begin(argv)
  harness.check_parallel(FLAGS.parallel)
  print(run(FLAGS.out, FLAGS.config, FLAGS.quick, FLAGS.parallel, FLAGS.moc, FLAGS.stages, FLAGS.only))
  print(f"{FLAGS.out}/evidence.md")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
