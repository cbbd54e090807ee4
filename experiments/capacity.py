"""`python -m experiments.capacity --out=DIR [--stages=preflight,gate,arms,confirm] [--quick] [--parallel=2]
[--config=configs/capacity.py:moc,words,entities=8192,readings=400,ramp=25600] [--records=RECORDS]`

Does a memory pay where the dense model runs out of room? configs/capacity.py sizes a store of facts against a
backbone too small to hold them (its docstring holds the arithmetic); this command runs the study in four stages,
each a sweep of that config run to completion in DIR/<sweep>/ (resumable and idempotent like launch/sweep.py: a
finished run is never trained again, an interrupted one resumes from its checkpoint), and writes DIR/capacity.md:

  preflight  the narrow backbone on PREFLIGHT_ENTITIES = 256 entities (a sixteenth of the default's; an eighth of
             fewer), each read as often as in the study (its curriculum, then the same readings): do these readings
             teach it these facts where it has room to spare?
  gate       the narrow backbone and the backbone at twice its width for a quarter of the steps at the rates of a
             search (lr_search: its own rate and a third of it, then a rate a third or three times further while the
             best is at an end; DIR/gate_lr/), then each at its best rate (DIR/gate/; the narrow one evaluated also
             as the run of half its steps would have ended: its cool-down, train.cooldowns), one seed: is the regime
             capacity-bound? A rate too high or too low stalls a backbone below what it can hold, so an untuned
             plateau would not say the backbone is full.
  arms       every arm (the iso-FLOP dense model and each memory arm the schema has) searched the same way (DIR/lr/),
             then each at its best rate (DIR/arms/)
  confirm    the memory arm with the best recall and the iso-FLOP dense model, at their rates, one run per seed, each
             seed on a corpus of its own, started first; and the same way the best memory arm addressed the other
             way (by the data's cluster tree, or by the model's own router: choose_confirmed says why both).

Every run scores fact recall (likelihood choice among 4 candidates, chance 0.25) and greedy exact match on 4,096
probes of facts it saw (train.num_probes: a binomial standard error of at most 0.0078; every fact, where the corpus
has fewer) at evaluations along it: the learning curve, DIR/<sweep>/recall_vs_tokens.png. Every run with memory is
evaluated once more with its memory knocked out (`python -m moc_jax.eval --ablate_chapters=routed`: every routable
chapter, or every value slot, zeroed).

The gate (gate_verdict) passes when all three hold:
  learnable      the preflight's recall is at least PREFLIGHT_RECALL = 0.9: the narrow backbone learns these facts
                 from these readings when there are few of them (so the readings are not what bounds it);
  plateaued      the narrow backbone's recall rose by at most PLATEAU_RISE = 0.02 from the run of half the steps to
                 the full run: twice the exposures no longer buy recall. Both are decayed: the shorter run is the
                 narrow run's cool-down at half its steps (the run up to its decay start, then its decay: bit for bit
                 the shorter run trained alone, for a tenth of the narrow run's steps); within one run, recall stalls
                 at a constant learning rate and jumps during the decay whatever bounds it
                 (docs/results/2026-11-26-smaller-backbone.md), so a run's own evaluations would not do. And the
                 plateau is at least
                 PLATEAU_FLOOR = 0.1 above chance: a backbone that holds nothing has not filled up, it has not
                 started (a model at 1 bit per parameter would hold half the default's facts);
  room           the wide model's recall beats the narrow one's by at least GATE_GAP = 0.05 and GATE_Z = 3 combined
                 binomial standard errors: more parameters hold more of the same facts, so the narrow backbone's
                 plateau is below the facts it saw. The wide backbone's rate-search run at its chosen rate (a quarter
                 of the steps) meets it already when it beats the narrow run by those margins: the wide run would
                 only read the same facts more often, so it is not trained (it saves the gate's longest run).
A check its finished runs fail fails the gate whatever the others show, so the stage trains its runs in that order
and stops (one line, exit 2, after the report) as soon as the gate cannot pass: not at all after a preflight under
0.9; the narrow run first, and the wide run (the longest, about half an hour at the default on a 2-core CPU) only if the
narrow one ended at or over the floor and had plateaued, and the wide search run did not already show the room. No
memory result counts without the gate: stages arms and confirm refuse to run (one error line, exit 2) until DIR holds
a gate that passed, and the report judges no goal without one. `--quick` (tiny shapes that test the harness in
minutes; CI runs it) runs every stage whatever the gate says, and its report still counts no goal without a gate that
passed.

The goal (goal_verdict, judged for each confirmed memory arm): the arm beats the iso-FLOP dense model on recall with
Welch's t of at least GOAL_T = 3 over the seeds, and knocking its memory out removes at least GOAL_HELD = 0.5 of its
recall above chance (means over seeds). Two arms judged are two chances at a t of 3 by luck: a record reads a verdict
knowing how many arms were confirmed.

--stages runs some stages (the study takes days on a CPU: split it over invocations or machines sharing DIR); a
stage left out is not run, but capacity.md reports what DIR holds of it. Where DIR does not survive from one part to
the next (a machine that keeps nothing from one job to the next), --records=RECORDS keeps what the parts need of it
(experiments/records.py: each finished and evaluated run without its checkpoints, about 160 kB, and each run stopped
before that with its newest checkpoint, about 1 MB, so that the next part resumes it): restored into DIR first,
brought up to date after every sweep, however it ended (a part ends well with one Ctrl-C), with capacity.md beside it;
docs/results/capacity-study/ is the default study's. The default `--config`,
`configs/capacity.py:moc,words,entities=8192,readings=400,ramp=25600`, is the size whose gate passed at untuned
rates (at the narrow backbone's searched rate it does not: +0.045, docs/results/2026-12-02-capacity-study-part2.md):
the biographies in words, 8,192 entities (352.0 kbit of facts, 14.2 bits per parameter of the d 32 narrow backbone,
3.57 of the d 64
wide one), each read 400 times, met a few more at a time over the quarter of the run after its curriculum (without
which the backbone stays at chance: docs/results/2026-11-29-capacity-gate-ramp.md). So far over its capacity, the
narrow backbone's gain from twice the readings is small in recall (about 0.25 bits per parameter a doubling at
capacity: 0.75 x 0.25 / 14.2 = 0.013 of recall; +0.011, +0.031, +0.033 in three model seeds, the check's edge, and
+0.009 in this command's own gate, which passed: docs/results/2026-12-01-capacity-study-part1.md), where at 3.57 bits
per parameter it was +0.055 and failed the plateau check (docs/results/2026-11-29-capacity-gate-words.md,
2026-11-30-capacity-gate-d32.md; configs/capacity.py's docstring has the hours). At the start of each stage the
command prints the corpus's bits of facts beside each model's parameters.
"""
from __future__ import annotations

import json
import math
import os
import time

from absl import flags

from experiments import harness, records
from experiments.evaluation import eval_seconds, evaluate_runs, evaluated
from experiments.sweeps import report
from experiments.sweeps.launch import run_to_completion
from experiments.sweeps.plan import IMPLIED, is_moc, plan, run_name
from experiments.sweeps.runs import MANIFEST, final_eval, finished, read_metrics
from moc_jax import cli

FLAGS = flags.FLAGS

STAGES = ("preflight", "gate", "arms", "confirm")
SWEEPS = {"preflight": ("preflight",), "gate": ("gate_lr", "gate"), "arms": ("lr", "arms"), "confirm": ("confirm",)}
SEARCHES = {"gate_lr": "gate", "lr": "arms"}  # the rate searches (lr_search), and the sweep that runs their choice
ALL_SWEEPS = tuple(sweep for stage in STAGES for sweep in SWEEPS[stage])
DEFAULT_CONFIG = "configs/capacity.py:moc,words,entities=8192,readings=400,ramp=25600"  # the docstring says why
CHANCE = 0.25  # likelihood choice among data.facts.num_candidates = 4
PREFLIGHT_RECALL = 0.9
PLATEAU_RISE, PLATEAU_FLOOR = 0.02, 0.1
GATE_GAP, GATE_Z = 0.05, 3.0
GOAL_T, GOAL_HELD = 3.0, 0.5
# What the stages' points vary beyond the arm itself, and the fields that follow them (the steps' schedule and
# curriculum: plan.IMPLIED): the arm of a point is its run name without them.
_VARIED = ("train.base_lr", "train.memory_lr", "train.steps", "train.cooldowns", "seed", "data.seed",
           "data.facts.seed")
RUN_KEYS = (*_VARIED, *(key for key, follows in IMPLIED.items() if follows in _VARIED and key not in _VARIED))
# The default size is configs/capacity.py's; quick tests the harness in minutes (CI): 16 entities (the first 16
# documents about 2 of them), 4 rows a step, 16 steps, no ramp after the curriculum (the default's would outgrow its 64
# documents), the first memory arm only (the stages treat every arm alike) and two seeds in `confirm` (Welch's t
# needs two).
SIZES = {
    "default": {"shapes": {}, "seeds": (0, 1, 2)},
    "quick": {"shapes": {"data.facts.num_entities": 16, "data.facts.num_docs": 64, "data.facts.num_val_docs": 16,
                         "train.batch_size": 4, "train.steps": 16, "train.warmup_steps": 1, "train.eval_every": 4,
                         "train.checkpoint_every": 8, "train.log_every": 4, "train.num_probes": 32,
                         "train.eval_batches": 1, "data.facts.warmup_entities": 2, "data.facts.warmup_docs": 16,
                         "data.facts.ramp_docs": 0},
              "seeds": (0, 1), "memory_arms": 1},
}


def define_flags():
  """This command's flags (defined only when it runs: other entry points define their own)."""
  harness.define_flags("capacity", "preflight/, gate/, lr/, arms/, confirm/, capacity.md",
                       "preflight, gate, lr, arms and confirm define the runs")
  FLAGS.set_default("config", DEFAULT_CONFIG)
  flags.DEFINE_list("stages", list(STAGES), "The stages to run, of preflight, gate, arms, confirm; the others are "
                    "reported from what DIR holds of them.")
  flags.DEFINE_string("records", "", "A directory of the study's finished runs without their checkpoints and its "
                      "stopped runs with their newest (experiments/records.py): restored into DIR first (a stopped run "
                      "resumes from its checkpoint), brought up to date after each sweep, "
                      "capacity.md beside them; for a study that goes on where DIR does not survive.")


# ---- the verdicts ----------------------------------------------------------------------------------------

def binomial_se(recall, probes) -> float:
  return math.sqrt(recall * (1 - recall) / probes) if probes else math.nan


def held_kbit(recall, fact_bits) -> float:
  """The facts a model holds, in kbit, read from its recall: a probe it knows it answers, one it does not it guesses
  (chance CHANCE), so it knows (recall - CHANCE) / (1 - CHANCE) of the probes, and of the facts' bits as much (the
  probes draw entities and attributes uniformly). Comparable with the 1-2 bits per parameter a transformer holds."""
  return max(0.0, (recall - CHANCE) / (1 - CHANCE)) * fact_bits / 1e3


def trained_parameters(config) -> int:
  """The parameters that can hold facts: the backbone without its tied embedding, and the memory."""
  from moc_jax import count_params
  counts = count_params(config)
  return counts["backbone"] - config.model.vocab_size * config.model.d_model + counts["bank"] + counts["memory_layers"]


def _unfinished(runs: dict) -> str:
  """A check's numbers when some of its runs are missing: which (the others may be running)."""
  missing = [name for name, run in runs.items() if run is None]
  return f"no finished {' and '.join(missing)} run{'s' if len(missing) > 1 else ''}"


def gate_verdict(preflight, narrow, half, wide, wide_quarter=None) -> dict:
  """The gate's rule on the runs' final scores, each {recall, probes} (None: not in DIR): {passed, checks: [(name,
  met, numbers)], lost, room_early}; a check whose runs are missing is not met; `lost` holds the numbers of the checks
  that failed on finished runs, each of which fails the gate whatever the runs still missing show (a narrow run that
  ended under the plateau's floor fails it whatever its recall at half the steps). `half` is the narrow run's
  cool-down at half its steps. `wide_quarter` is the wide backbone's run of its rate search at the rate the gate runs
  it at (a quarter of the steps): where it already beats the narrow run by the room check's margins, the room check
  is met (`room_early`) without the wide run, since more readings of the same facts do not lower what a backbone
  holds; where it does not, the wide run decides."""
  checks, lost = [], []

  def check(name, met, numbers, decided=True):
    checks.append((name, met, numbers))
    if decided and not met:
      lost.append(numbers)
  if preflight is None:
    check("learnable", False, "no finished preflight", decided=False)
  else:
    check("learnable", preflight["recall"] >= PREFLIGHT_RECALL,
          f"preflight recall {preflight['recall']:.3f} (needs ≥ {PREFLIGHT_RECALL:g})")
  if narrow is not None and narrow["recall"] < CHANCE + PLATEAU_FLOOR:
    check("plateaued", False, f"narrow recall {narrow['recall']:.3f} at all the steps, under the floor "
          f"{CHANCE + PLATEAU_FLOOR:g}: it has not started taking the facts up, whatever it recalled at half the steps")
  elif narrow is None:
    check("plateaued", False, _unfinished({"narrow": narrow}), decided=False)
  elif half is None:
    check("plateaued", False, "the narrow run has no cool-down at half its steps (train.cooldowns)", decided=False)
  else:
    # in probes too: a rise within a probe of the bound reads as the bound itself at 3 digits
    rise, probes = narrow["recall"] - half["recall"], narrow["probes"]
    check("plateaued", rise <= PLATEAU_RISE, f"narrow recall {half['recall']:.3f} at half the steps, "
          f"{narrow['recall']:.3f} at all of them: {rise:+.3f}, {rise * probes:+.0f} of {probes:,} probes (needs ≤ "
          f"{PLATEAU_RISE:+g}, {PLATEAU_RISE * probes:.1f} probes, at ≥ {CHANCE + PLATEAU_FLOOR:g})")
  early = wide is None and narrow is not None and wide_quarter is not None and _room(wide_quarter, narrow)[0]
  if early:
    check("room", True, f"wide recall {wide_quarter['recall']:.3f} after a quarter of the steps (its rate search's "
          f"run) against narrow {narrow['recall']:.3f} after all of them: {_room(wide_quarter, narrow)[1]}; the wide "
          "run is not trained (more readings of the same facts do not lower what it holds)")
  elif narrow is None or wide is None:
    check("room", False, _unfinished({"narrow": narrow, "wide": wide}), decided=False)
  else:
    met, numbers = _room(wide, narrow)
    check("room", met, f"wide recall {wide['recall']:.3f} against narrow {narrow['recall']:.3f}: {numbers}")
  return {"passed": all(met for _, met, _ in checks), "checks": checks, "lost": lost, "room_early": early}


def _room(wide, narrow) -> tuple[bool, str]:
  """The room check on two scores: (met, its numbers)."""
  gap = wide["recall"] - narrow["recall"]
  z = gap / math.hypot(binomial_se(wide["recall"], wide["probes"]), binomial_se(narrow["recall"], narrow["probes"]))
  return gap >= GATE_GAP and z >= GATE_Z, (f"{gap:+.3f}, {z:+.1f} combined standard errors (needs ≥ {GATE_GAP:+g} "
                                           f"and ≥ {GATE_Z:g})")


def goal_verdict(memory, dense) -> dict:
  """The goal on the confirmation's runs: `memory` [{recall, knockout}] and `dense` [{recall}], one per seed.
  {met, t, df, held, memory: (mean, se), dense: (mean, se), knockout: (mean, se)}; `held` is the share of the memory
  arm's recall above chance that its knock-out removes, from the means."""
  recall = [r["recall"] for r in memory]
  knockout = [r["knockout"] for r in memory]
  t, df = report.welch_t(recall, [r["recall"] for r in dense])
  mean, knocked = sum(recall) / len(recall), sum(knockout) / len(knockout)
  held = (mean - knocked) / (mean - CHANCE) if mean > CHANCE else math.nan
  return {"met": t >= GOAL_T and held >= GOAL_HELD, "t": t, "df": df, "held": held,
          "memory": report.mean_and_se(recall), "dense": report.mean_and_se([r["recall"] for r in dense]),
          "knockout": report.mean_and_se(knockout)}


# ---- the runs of a stage ---------------------------------------------------------------------------------

def arm_of(overrides, shapes) -> str:
  """A point's arm: the run name of its overrides without what the stages vary around it (rate, steps, seed,
  corpus) and the size's `shapes` every point shares."""
  return run_name({k: v for k, v in overrides.items() if k not in RUN_KEYS and shapes.get(k, ()) != v})


def _plan(spec, sweep, size):
  """The sweep's points at this size: its shapes as the base of every point (a point keeps what it sets itself), the
  first `memory_arms` memory arms if the size names how many."""
  points = plan(spec, sweep, base=size["shapes"])
  memory = list(dict.fromkeys(arm_of(p.overrides, size["shapes"]) for p in points if is_moc(p.config)))
  kept = memory[:size.get("memory_arms", len(memory))]
  return [p for p in points if not is_moc(p.config) or arm_of(p.overrides, size["shapes"]) in kept]


def read_runs(out, sweep, size) -> list[dict] | None:
  """What DIR/<sweep> holds, one dict per run of its manifest: report.run_rows's columns, and `arm`, `lr`, `probes`
  (of its final evaluation), `recall_se`, `knockout` (recall with its memory knocked out, if evaluated),
  `tree_read` (its memory is addressed by the data's cluster tree), `entity_recall`, `path_agreement` and
  `path_alone` (a cluster arm's recall with each probe on its entity's path, the share of prompts whose own path is
  that one at the tree's last level, and the recall of the path by itself: moc_jax.eval's entity_paths), `curve`
  [(training tokens, recall, exact match)], `cooled` {the step a cool-down ended at: {recall, probes, exact_match,
  val_ce, tokens}}, `fact_bits` (of its corpus), `parameters` (trained_parameters) and `eval_s`; None when DIR has no
  such sweep."""
  from moc_jax.config import load_run_config
  from moc_jax.config.schema import TREE_ROUTINGS
  from moc_jax.data.facts import fact_bits
  from moc_jax.train.cooldown import SPLIT
  sweep_dir = os.path.join(out, sweep)
  if not os.path.exists(os.path.join(sweep_dir, MANIFEST)):
    return None
  runs = []
  for row in report.run_rows(sweep_dir):
    run = {**row, "arm": arm_of(row["overrides"], size["shapes"]), "eval_s": eval_seconds(row["workdir"])}
    if row["status"] == "done":
      config = load_run_config(row["workdir"])
      per_step = config.train.batch_size * config.train.grad_accum * config.data.seq_len
      final, metrics = final_eval(row["workdir"], config.train.steps), read_metrics(row["workdir"])
      entity = report.eval_report(row["workdir"]).get("entity_paths") or {}
      run.update(entity_recall=entity.get("fact_recall", {}).get("probe_acc"),
                 path_agreement=entity["agreement"][-1] if entity else None, path_alone=entity.get("path_alone"))
      run.update(lr=config.train.base_lr, probes=final.get("num_probes", 0), recall=row["fact_recall"],
                 knockout=row.get("recall_without_bank"), memory=is_moc(config),
                 tree_read=config.memory.routing in TREE_ROUTINGS,
                 fact_bits=fact_bits(config.data.facts)["total"], parameters=trained_parameters(config),
                 curve=[(r["step"] * per_step, r["probe_acc"], r["probe_exact"]) for r in metrics
                        if r.get("split") == "validation" and "probe_acc" in r],
                 cooled={r["cooldown_end"]: {"recall": r["probe_acc"], "probes": r.get("num_probes", 0),
                                             "exact_match": r["probe_exact"], "val_ce": r["ce"],
                                             "tokens": r["cooldown_end"] * per_step}
                         for r in metrics if r.get("split") == SPLIT and "probe_acc" in r})
      run["recall_se"] = binomial_se(run["recall"], run["probes"])
    runs.append(run)
  return runs


def read_all(out, size) -> dict:
  """sweep -> read_runs of every sweep of every stage: read again before each stage and the report, so that what
  invocations sharing DIR finished meanwhile counts."""
  return {sweep: read_runs(out, sweep, size) for sweep in ALL_SWEEPS}


def _done(runs) -> list[dict]:
  return [r for r in runs or () if r["status"] == "done"]


def _by_name(runs, name) -> dict | None:
  return next((r for r in _done(runs) if r["run"] == name), None)


def _best(runs) -> dict:
  """The run with the highest recall (then the lower validation CE)."""
  return max(runs, key=lambda r: (r["recall"], -r["val_ce"]))


def choose_rates(lr_runs) -> dict:
  """arm -> its rate: the finished `lr` run of the arm with the best recall (_best)."""
  arms = {}
  for r in _done(lr_runs):
    arms.setdefault(r["arm"], []).append(r)
  return {arm: _best(runs)["lr"] for arm, runs in arms.items()}


def lr_search(points, runs, shapes) -> tuple[list, dict]:
  """The points of a rate search (sweep `gate_lr` or `lr`) to run given its finished `runs`, and per model {rates:
  [the rungs run, or to run], best: the rate of _best so far (None before a run finished), state: `bracketed` (a
  finished worse rung on either side of the best), `at the ladder's end` or `searching`}. A model's points are the
  rungs of its rates (configs/capacity.py LR_MULTIPLES, in the order the search may reach them); it runs its first
  two points first, then, while the best of what it has finished is the lowest or the highest of its rungs so far,
  the next rung past it, up to the ends of the ladder. Three runs when the best is either starting rung, and never a
  rate picked at the edge of what was tried unless the ladder ends there (the report says so)."""
  done = {(r["arm"], r["lr"]): r for r in _done(runs)}
  arms, todo, search = {}, set(), {}
  for p in points:
    arms.setdefault(arm_of(p.overrides, shapes), []).append(p)
  for arm, rungs in arms.items():
    start = sorted(p.config.train.base_lr for p in rungs[:2])
    rungs.sort(key=lambda p: p.config.train.base_lr)
    rates = [p.config.train.base_lr for p in rungs]
    lo, hi, state = rates.index(start[0]), rates.index(start[-1]), "searching"
    while all((arm, x) in done for x in rates[lo:hi + 1]):
      best = rates.index(_best([done[arm, x] for x in rates[lo:hi + 1]])["lr"])
      if best == lo and lo > 0:
        lo -= 1
      elif best == hi and hi < len(rates) - 1:
        hi += 1
      else:
        state = "bracketed" if lo < best < hi else "at the ladder's end"
        break
    finished = [done[arm, x] for x in rates[lo:hi + 1] if (arm, x) in done]
    todo.update(p.name for p in rungs[lo:hi + 1])
    search[arm] = {"rates": rates[lo:hi + 1], "best": _best(finished)["lr"] if finished else None, "state": state}
  return [p for p in points if p.name in todo], search


def choose_confirmed(arm_runs) -> tuple[list[dict], dict] | None:
  """([the memory arms' runs to confirm], the dense run they are confirmed against) among the finished `arms` runs;
  None without both kinds. First the memory arm with the best recall (_best), then the best of the memory arms
  addressed the other way, when there is one: by the data's cluster tree, an index from outside the model, or by
  the model's own router (`tree_read`). The two answer different questions: a bank read by a tree of the documents'
  subjects tests what a memory can store, a memory read by its own router whether a model finds what it stored. The
  dense arm's run nearest the first in FLOPs per token is their iso-FLOP model."""
  done = _done(arm_runs)
  memory = [r for r in done if r["memory"]]
  dense = [r for r in done if not r["memory"]]
  if not memory or not dense:
    return None
  best = _best(memory)
  other = [r for r in memory if r["tree_read"] != best["tree_read"]]
  return [best, *([_best(other)] if other else [])], min(
      dense, key=lambda r: abs(r["flops_per_token"] - best["flops_per_token"]))


def sweep_points(spec, sweep, size, runs) -> list:
  """The points of `sweep` its stage runs, given what DIR holds (`runs`: sweep -> read_runs): `gate_lr` and `lr` the
  rungs their search needs next (lr_search), `gate` and `arms` each model at the rate its search chose, `confirm` the
  arms choose_confirmed chooses at their rates, once per seed of the size; `preflight` its point. Raises UsageError
  when `arms` is not finished for `confirm`."""
  from moc_jax.errors import UsageError
  points = _plan(spec, sweep, size)
  if sweep in SEARCHES:
    return lr_search(points, runs.get(sweep), size["shapes"])[0]
  searched = next((search for search, chosen in SEARCHES.items() if chosen == sweep), None)
  if searched:
    rates = choose_rates(runs.get(searched))
  elif sweep == "confirm":
    chosen = choose_confirmed(runs.get("arms"))
    done = {r["arm"] for r in _done(runs.get("arms"))}
    planned = {arm_of(p.overrides, size["shapes"]) for p in _plan(spec, "arms", size)}
    if chosen is None or done != planned:
      raise UsageError(f"stage confirm needs every arm of stage arms finished ({len(done)} of {len(planned)}); run "
                       "--stages=arms first")
    memories, dense = chosen
    rates = {r["arm"]: r["lr"] for r in [*memories, dense]}
    points = [p for p in points if p.config.seed in size["seeds"]]
  else:
    return points
  return [p for p in points if rates.get(arm_of(p.overrides, size["shapes"])) == p.config.train.base_lr]


def _first(out, sweep, points, size) -> set[str]:
  """The points a sweep starts before its others: in `confirm`, the best memory arm's and the iso-FLOP dense
  model's, on which the goal's first verdict waits; the other addressing's runs take the slots they leave."""
  chosen = choose_confirmed(read_runs(out, "arms", size)) if sweep == "confirm" else None
  if chosen is None:
    return set()
  arms = {chosen[0][0]["arm"], chosen[1]["arm"]}
  return {p.name for p in points if arm_of(p.overrides, size["shapes"]) in arms}


def _run_sweep(out, spec, sweep, points, parallel, size) -> None:
  """Trains `points` in DIR/<sweep> to completion, evaluates those with memory with it knocked out, collects the
  sweep's tables and plots the learning curves of what DIR/<sweep> then holds. The evaluations run however the
  training ended: a sweep stopped (Ctrl-C, SIGTERM) or cut short by a failed run still has its finished runs
  evaluated, so that a record (--records) keeps them; a second Ctrl-C stops that too."""
  sweep_dir = os.path.join(out, sweep)
  try:
    run_to_completion(sweep_dir, spec, sweep, points, parallel, "capacity", first=_first(out, sweep, points, size))
  finally:
    workdirs = {p.name: os.path.join(sweep_dir, p.name) for p in points}
    evaluate_runs([(workdirs[p.name], True) for p in points
                   if is_moc(p.config) and finished(workdirs[p.name], p.config.train.steps)], parallel, "capacity")
  report.collect(sweep_dir)
  plot_curves(read_runs(out, sweep, size), os.path.join(sweep_dir, "recall_vs_tokens.png"), sweep)


def capacity_lines(points, shapes) -> list[str]:
  """Per distinct model and corpus of `points`: the bits of facts its training states beside its parameters."""
  from moc_jax import count_params
  from moc_jax.data.facts import fact_bits
  lines, seen = [], set()
  for p in points:
    key = (arm_of(p.overrides, shapes), p.config.data.facts.num_entities, p.config.data.facts.num_docs)
    if key in seen:
      continue
    seen.add(key)
    bits, counts, trained = fact_bits(p.config.data.facts), count_params(p.config), trained_parameters(p.config)
    memory = counts["bank"] + counts["memory_layers"]
    lines.append(f"{key[0]}: {bits['total'] / 1e3:,.1f} kbit of facts ({bits['entities']:,} entities x "
                 f"{bits['per_entity']:.2f} bits) against {trained - memory:,} parameters without the embedding"
                 + (f" + {memory:,} of memory" if memory else "")
                 + f": {bits['total'] / trained:.3g} bits per parameter")
  return lines


# ---- the report ------------------------------------------------------------------------------------------

def plot_curves(runs, path, title) -> None:
  """Recall (solid) and exact match (dotted) against training tokens, one colour per run; its cool-downs' recall as
  stars where they ended."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  done = [r for r in _done(runs) if r["curve"]]
  if not done:
    return
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for r in done:
    tokens, recall, exact = zip(*r["curve"])
    line = ax.plot(tokens, recall, "o-", ms=3, label=r["run"])[0]
    ax.plot(tokens, exact, ":", color=line.get_color())
    cooled = sorted(r["cooled"].values(), key=lambda c: c["tokens"])
    ax.plot([c["tokens"] for c in cooled], [c["recall"] for c in cooled], "*", ms=10, color=line.get_color())
  ax.axhline(CHANCE, color="grey", lw=0.8, ls="--")
  ax.set_xlabel("training tokens (row slots)")
  ax.set_ylabel("fact recall (solid; cooled down: stars), exact match (dotted)", fontsize=8)
  ax.set_title(title), ax.set_ylim(0, 1), ax.grid(alpha=0.3), ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _num(value, digits=3) -> str:
  return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def entity_cell(r) -> str:
  """A cluster arm's recall with every probe on its entity's path, and (in brackets) the share of prompts already
  there and what the path alone recalls: recall well above its own and above the path's with few prompts there says
  the store holds facts that the tree does not reach."""
  if r.get("entity_recall") is None:
    return ""
  return f"{r['entity_recall']:.3f} ({r['path_agreement']:.2f}; path alone {r['path_alone']:.3f})"


def runs_table(runs) -> list[str]:
  """A row per run (and per cool-down of it); `facts held` is held_kbit of its corpus's, and per trained parameter."""
  lines = [("| run | LR | steps | tokens | FLOPs/token | recall ± SE | exact match | facts held, kbit (per parameter) "
            "| recall, memory knocked out | recall, probes on their entity's path (prompts there; the path alone) | val CE "
            "| wall s |"),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

  def held(r, recall):
    kbit = held_kbit(recall, r["fact_bits"])
    return f"{kbit:.3g} of {r['fact_bits'] / 1e3:.3g} ({kbit * 1e3 / r['parameters']:.3g})"
  for r in runs:
    if r["status"] != "done":
      lines.append(f"| {r['run']} | | | | | {r['status']}: {r.get('note', '')} | | | | | | |")
      continue
    lines.append(f"| {r['run']} | {r['lr']:g} | {r['steps']:,} | {r['tokens']:,} | {r['flops_per_token']:,.0f} | "
                 f"{r['recall']:.3f} ± {r['recall_se']:.3f} | {r['exact_match']:.3f} | {held(r, r['recall'])} | "
                 f"{_num(r['knockout'])} | {entity_cell(r)} | {r['val_ce']:.4f} | {r['wall_s']:,.0f} |")
    for end, c in sorted(r["cooled"].items()):
      lines.append(f"| {r['run']}, cooled down at step {end:,} | | {end:,} | {c['tokens']:,} | | {c['recall']:.3f} ± "
                   f"{binomial_se(c['recall'], c['probes']):.3f} | {c['exact_match']:.3f} | {held(r, c['recall'])} | | | "
                   f"{c['val_ce']:.4f} | |")
  return lines


def search_table(search) -> list[str]:
  """A rate search per model (lr_search's second value)."""
  lines = ["| model | rates | best | search |", "|---|---|---:|---|"]
  return lines + [f"| {arm} | {', '.join(f'{x:g}' for x in s['rates'])} | "
                  f"{'' if s['best'] is None else format(s['best'], 'g')} | {s['state']} |"
                  for arm, s in search.items()]


def markdown(spec, size_name, runs, gate, goals, refusal, wall, machine, search=None) -> str:
  """capacity.md: each stage DIR holds (`wall`: the stages this invocation ran, and how long each took), each rate
  search per model (`search`: sweep -> lr_search's), the gate's verdict, the goal's per confirmed arm (`goals`:
  _goals'), the wall times."""
  flag = " --quick" if size_name == "quick" else ""
  lines = [f"# Does memory pay? `python -m experiments.capacity --config={spec}{flag}`", "",
           (f"Size `{size_name}`; {machine}. Fact recall: likelihood choice among 4 candidates (chance {CHANCE:g}) "
            "on the final evaluation's probes, ± its binomial standard error; exact match: greedy; knocked out: "
            "`python -m moc_jax.eval --ablate_chapters=routed` (every routable chapter or value slot zeroed); a "
            "cluster arm's probes on their entity's path: each reads the chapters its entity's training documents "
            "read instead of its prompt's (in brackets the share of prompts whose path that is, and the recall of "
            "the path alone: the value most other entities on it hold, as the path is fitted on whole biographies); "
            "facts held: the corpus's bits of facts times the share of probes known above chance, and per parameter "
            "without the embedding (a transformer holds about 1 to 2)."), ""]
  titles = {"preflight": "Stage `preflight`: can the narrow backbone learn these facts?",
            "gate_lr": "Stage `gate`, the learning-rate search (a quarter of the steps)",
            "gate": "Stage `gate`: narrow (and its cool-down at half the steps), wide, each at its rate",
            "lr": "Stage `arms`, the learning-rate search (a quarter of the steps)",
            "arms": "Stage `arms`: every arm at its rate", "confirm": "Stage `confirm`: one run per seed and corpus"}
  for stage in STAGES:
    for sweep in SWEEPS[stage]:
      if runs.get(sweep) is None:
        continue
      note = [] if stage in wall else ["Not run by this invocation: what DIR holds.", ""]
      lines += [f"## {titles[sweep]}", "", *note, *runs_table(runs[sweep]), "",
                f"![recall vs tokens]({sweep}/recall_vs_tokens.png)", ""]
      if (search or {}).get(sweep):
        lines += ["Each model's rates (lr_search: from its own rate and a third of it, a rung further while the best "
                  "is at an end):", "", *search_table(search[sweep]), ""]
  lines += ["## The gate: " + ("**passed**" if gate["passed"] else "**not passed**"), "",
            "| check | met | numbers |", "|---|---|---|"]
  lines += [f"| {name} | {'yes' if met else '**no**'} | {numbers} |" for name, met, numbers in gate["checks"]]
  lines += ["", "## The goal", ""]
  if not goals:
    lines.append("Not judged: DIR holds no finished confirmation.")
  for i, goal in enumerate(goals):
    verdict = ("**met**" if goal["met"] else "**not met**") if gate["passed"] else (
        "not counted: the gate did not pass, so the regime is not shown to be capacity-bound")
    m, d, k = goal["memory"], goal["dense"], goal["knockout"]
    lines += [""] * (i > 0)  # a paragraph per confirmed arm
    lines.append(f"{verdict}. {goal['arm']} recalls {m[0]:.3f} ± {_num(m[1])} against the iso-FLOP dense model's "
                 f"{d[0]:.3f} ± {_num(d[1])} ({goal['dense_arm']}; mean ± standard error over {goal['n']} seeds and "
                 f"corpora): Welch's t {goal['t']:+.2f} ({goal['df']:.1f} degrees of freedom; needs ≥ {GOAL_T:g}). "
                 f"Its memory knocked out, it recalls {k[0]:.3f} ± {_num(k[1])}: the memory holds "
                 f"{_num(goal['held'])} of its recall above chance (needs ≥ {GOAL_HELD:g}).")
  if refusal:
    lines += ["", f"Stopped: {refusal}"]
  lines += ["", "## Wall time", "", "| stage | runs (s, summed) | evaluations (s, summed) | this invocation (s) |",
            "|---|---:|---:|---:|"]
  for stage in STAGES:
    held = [r for sweep in SWEEPS[stage] for r in runs.get(sweep) or ()]
    if held or stage in wall:
      lines.append(f"| {stage} | {sum(r.get('wall_s') or 0 for r in held):,.0f} | "
                   f"{sum(r['eval_s'] for r in held):,.0f} | {_num(wall.get(stage), 0)} |")
  return "\n".join(lines) + "\n"


# ---- the command -----------------------------------------------------------------------------------------

def _narrow(point) -> bool:
  """The gate's narrow run (the one cooled down at half its steps), not its wide one."""
  return bool(point.config.train.cooldowns)


def _gate(spec, size, runs) -> dict:
  """gate_verdict on the preflight and the gate runs DIR holds at the rates the `gate_lr` search chose (planned to
  find them by name), and the wide backbone's `gate_lr` run at its chosen rate."""
  def score(r):
    return None if r is None else {"recall": r["recall"], "probes": r["probes"]}
  preflight = _plan(spec, "preflight", size)[0].name
  chosen = sweep_points(spec, "gate", size, runs)
  narrow, wide = (next((p for p in chosen if _narrow(p) == n), None) for n in (True, False))
  run = None if narrow is None else _by_name(runs.get("gate"), narrow.name)
  half = None if run is None else run["cooled"].get(round(run["steps"] / 2))
  quarter = None if wide is None else next(
      (r for r in _done(runs.get("gate_lr")) if r["arm"] == arm_of(wide.overrides, size["shapes"])
       and r["lr"] == wide.config.train.base_lr), None)
  return gate_verdict(score(_by_name(runs.get("preflight"), preflight)), score(run), half,
                      score(None if wide is None else _by_name(runs.get("gate"), wide.name)), score(quarter))


def _goals(runs) -> list[dict]:
  """goal_verdict per memory arm of the confirmation DIR holds (two seeds or more of it and of the dense arm), in
  the order choose_confirmed confirms them."""
  done = _done(runs.get("confirm"))
  dense = [r for r in done if not r["memory"]]
  if len(dense) < 2:
    return []
  arms = {}
  for r in done:
    if r["memory"] and r["knockout"] is not None:
      arms.setdefault(r["arm"], []).append(r)
  chosen = choose_confirmed(runs.get("arms"))
  order = [r["arm"] for r in chosen[0]] if chosen else []
  ranked = sorted(arms, key=lambda arm: order.index(arm) if arm in order else len(order))
  return [{**goal_verdict(arms[arm], dense), "arm": arm, "dense_arm": dense[0]["arm"], "n": len(arms[arm])}
          for arm in ranked if len(arms[arm]) >= 2]


def _phases(sweep, points) -> list[list]:
  """The points of `sweep` in the order the gate can fail on them, each phase the points up to it: the gate's narrow
  run (its plateau check, with its cool-down), then both (the wide run: the longest, and useless to train once the
  plateau check has failed, or once its rate search's run has met the room check); any other sweep in one phase."""
  if sweep != "gate":
    return [points]
  return [[p for p in points if _narrow(p)], points]


def _gate_lost(verdict) -> str | None:
  """The refusal of the gate's next runs when the runs DIR holds have already failed it (`verdict`: _gate's); None
  while it can pass."""
  if not verdict["lost"]:
    return None
  return (f"stage gate stopped: {'; '.join(verdict['lost'])}; the gate cannot pass, so its other runs are not trained "
          "(the levers: configs/capacity.py's readings=N, warm=N, ramp=N, entities=N, narrow=D; the corpus sizes "
          "where it could pass: python -m experiments.capacity_window --run=<the narrow gate run's directory>)")


def _train_phases(out, spec, sweep, points, parallel, size, quick) -> str | None:
  """Trains `points` phase by phase (_phases), the gate's next phase only while its finished runs leave it able to
  pass (always when quick), and without the wide run once the room check is met without it; returns the refusal
  that stopped it, None when every point was trained."""
  trained = None
  for phase in _phases(sweep, points):
    if sweep in SWEEPS["gate"]:
      verdict = _gate(spec, size, read_all(out, size))
      refusal = None if quick else _gate_lost(verdict)
      if refusal:
        return refusal
      if sweep == "gate" and verdict["room_early"]:
        phase = [p for p in phase if _narrow(p)]
    if phase != trained:
      _run_sweep(out, spec, sweep, phase, parallel, size)
    trained = phase
  return None


def _complete(workdir, entry) -> bool:
  """A run the record keeps: trained to its end and, with memory, evaluated with it knocked out as well."""
  from moc_jax.config import load_run_config
  if entry.get("status") != "done" or not finished(workdir, entry["steps"]):
    return False
  return not is_moc(load_run_config(workdir)) or evaluated(workdir, True)


def _keep(out, kept) -> None:
  """Brings the record `kept` (--records) up to date with DIR's complete runs; nothing without one."""
  if kept:
    records.save(out, kept, ALL_SWEEPS, _complete)


def run(out, spec, quick, parallel, stages=STAGES, kept="") -> str:
  """Runs `stages` in order and writes DIR/capacity.md over every stage DIR holds; returns its text. A stage whose
  prerequisite is missing (arms and confirm: a gate that passed, unless quick; confirm: every arm finished) stops
  the command with one line, after the report; so does the gate once its finished runs fail it (unless quick: each
  phase of _phases is trained only while the gate can pass), and a run that did not finish. `kept`: a record
  (--records, experiments/records.py) restored into DIR first and brought up to date after each sweep, however the
  sweep ended, with capacity.md beside it."""
  from moc_jax.errors import UsageError
  from moc_jax.train.peaks import cpu_model
  unknown = sorted(set(stages) - set(STAGES))
  if unknown or not stages:
    raise UsageError(f"--stages={','.join(stages)}: name one or more of {', '.join(STAGES)}")
  size_name = "quick" if quick else "default"
  size, out = SIZES[size_name], os.path.abspath(out)
  if kept:
    planned = {(sweep, p.name): json.loads(p.config.to_json_best_effort(sort_keys=True))
               for sweep in ALL_SWEEPS for p in _plan(spec, sweep, size)}
    restored = records.restore(kept, out, ALL_SWEEPS, spec, planned)
    print(f"capacity: {restored} run{'s' * (restored != 1)} restored from {kept} (a stopped one resumes from its "
          "checkpoint)", flush=True)
  os.makedirs(out, exist_ok=True)
  wall, refusal, stopped = {}, None, None
  for stage in STAGES:
    if stage not in stages:
      continue
    runs = read_all(out, size)  # another invocation sharing DIR may have finished runs since
    gate = _gate(spec, size, runs)
    if stage in ("arms", "confirm") and not gate["passed"] and not quick:
      failed = "; ".join(numbers for _, met, numbers in gate["checks"] if not met)
      refusal = (f"stage {stage} not run: the gate has not passed ({failed}); no memory result counts without it "
                 "(run --stages=preflight,gate first)")
      break
    t0 = time.time()
    for sweep in SWEEPS[stage]:
      trained = None  # the points of the round before: a sweep is done when the next round asks for no others
      while not (refusal or stopped):
        try:
          todo = sweep_points(spec, sweep, size, runs)
        except UsageError as e:
          refusal = str(e)
          break
        if [p.name for p in todo] == trained:
          break  # one round but for a rate search, whose rounds each add a rung where a model's best is at an end
        trained = [p.name for p in todo]
        count = f"{len(todo)} run" + "s" * (len(todo) != 1)
        print(f"capacity: stage {stage}, sweep {sweep} ({count}):", *capacity_lines(todo, size["shapes"]),
              sep="\n  ", flush=True)
        try:
          refusal = _train_phases(out, spec, sweep, todo, parallel, size, quick)
        except SystemExit as e:  # a run did not finish: the report still says what the finished ones show
          stopped = e
        _keep(out, kept)
        runs[sweep] = read_runs(out, sweep, size)  # the next round reads it, and the next sweep (arms: the lr runs)
      if refusal or stopped:
        break
    if refusal or stopped:
      break
    wall[stage] = time.time() - t0
  runs = read_all(out, size)  # what DIR holds now, the other invocations' runs included
  machine = f"{os.cpu_count()} cores of {cpu_model()}, {time.strftime('%Y-%m-%d')}"
  search = {sweep: lr_search(_plan(spec, sweep, size), runs[sweep], size["shapes"])[1]
            for sweep in SEARCHES if runs.get(sweep) is not None}
  text = markdown(spec, size_name, runs, _gate(spec, size, runs), _goals(runs), refusal, wall, machine, search)
  for where in (out, kept):
    if where:
      os.makedirs(where, exist_ok=True)
      with open(os.path.join(where, "capacity.md"), "w") as f:
        f.write(text)
  if refusal or stopped:
    print(text)
  if stopped:
    raise stopped
  if refusal:
    raise UsageError(refusal)
  return text


def main(argv):
  cli.begin(argv)
  harness.check_parallel(FLAGS.parallel)
  print(run(FLAGS.out, FLAGS.config, FLAGS.quick, FLAGS.parallel, FLAGS.stages, FLAGS.records))
  print(f"{FLAGS.out}/capacity.md")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
