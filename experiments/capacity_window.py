"""The capacity gate's window, read from one narrow run's cool-downs: at which readings, and on which corpus sizes,
the gate's rule can call that backbone full.

The gate (experiments/capacity.py gate_verdict) calls the narrow backbone full when its recall rose by at most
PLATEAU_RISE from half its readings to all of them and ended at CHANCE + PLATEAU_FLOOR or more. Say the backbone
holds H bits of facts after n readings of each entity and dH fewer after n / 2 (held_kbit). On a corpus of T bits
its recall is then CHANCE + (1 - CHANCE) H / T and its rise (1 - CHANCE) dH / T, so the plateau check needs
T >= (1 - CHANCE) dH / PLATEAU_RISE and the floor T <= (1 - CHANCE) H / PLATEAU_FLOOR. Both hold only when
dH / H <= PLATEAU_RISE / PLATEAU_FLOOR, and then over a factor (PLATEAU_RISE / PLATEAU_FLOOR) / (dH / H) of corpus
sizes. A run whose cool-downs end at successive halvings of its readings (`train.cooldowns=(0.125,0.25,0.5)`)
therefore tells, before a gate is spent on a guess, at which readings the window opens, how wide it is and how many
entities it spans.

The window is an estimate: it takes H as the backbone's whatever the corpus, where the d 16 backbone held more of a
larger corpus at the same readings (24.3, 25.9 and 28.4 kbit of 6,144, 6,912 and 8,192 entities after 100 readings:
docs/results/2026-12-06-capacity-gate-n16.md), and it reads one seed.

`python -m experiments.capacity_window --run=WORKDIR` (a finished or running training run's directory)
"""
from __future__ import annotations

import os

from absl import flags

from experiments.capacity import CHANCE, PLATEAU_FLOOR, PLATEAU_RISE, binomial_se, held_kbit
from experiments.sweeps.runs import final_eval, read_metrics
from moc_jax import cli
from moc_jax.errors import UsageError

_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_string("run", None, "a training run's directory (it holds config.json and metrics.jsonl)",
                    flag_values=_FLAGS)


def curve(rows, steps, readings, fact_bits) -> list[dict]:
  """The annealed learning curve: per evaluation row of a cool-down (`cooldown_end`) or of the run's end (`step` ==
  steps), its readings of each entity (the run's `readings` in proportion to its updates), recall, probes, exact
  match and the kbit of facts held, in order of updates."""
  points = [{"updates": r.get("cooldown_end", r["step"]), "recall": r["probe_acc"], "probes": r["num_probes"],
             "exact": r["probe_exact"]} for r in rows]
  for p in points:
    p.update(readings=readings * p["updates"] / steps, held=held_kbit(p["recall"], fact_bits))
  return sorted(points, key=lambda p: p["updates"])


def window(held, gain, bits_per_entity) -> tuple[float, float] | None:
  """The entities of the corpora on which a backbone holding `held` kbit, `gain` of them won in the last doubling of
  its readings, passes the plateau check and the floor (the module's docstring); None when no corpus does. A backbone
  that gained nothing passes the plateau check on any corpus, so its window starts at 0."""
  smallest = max(0.0, (1 - CHANCE) * gain / PLATEAU_RISE * 1e3 / bits_per_entity)
  largest = (1 - CHANCE) * held / PLATEAU_FLOOR * 1e3 / bits_per_entity
  return (smallest, largest) if smallest <= largest else None


def table(points, bits_per_entity) -> list[str]:
  """A markdown row per point; a point at twice the readings of the one before it also gets the rise, dH / H and
  the window of that doubling."""
  lines = ["| readings | updates | recall | exact | held, kbit | rise from half, probes | dH / H | window, entities |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for before, p in zip([None, *points], points):
    cells = [f"{p['readings']:,.0f}", f"{p['updates']:,}",
             f"{p['recall']:.3f} ± {binomial_se(p['recall'], p['probes']):.3f}", f"{p['exact']:.3f}",
             f"{p['held']:.1f}"]
    if before and abs(p["updates"] - 2 * before["updates"]) <= 1:
      gain = p["held"] - before["held"]
      span = window(p["held"], gain, bits_per_entity)
      cells += [f"{p['recall'] - before['recall']:+.3f}, {round((p['recall'] - before['recall']) * p['probes']):+,}",
                f"{gain / p['held']:.3f}" if p["held"] else "",
                _entities(span)]
    lines.append("| " + " | ".join(cells + [""] * (8 - len(cells))) + " |")
  return lines


def _entities(span) -> str:
  if span is None:
    return "none"
  return f"up to {span[1]:,.0f}" if span[0] == 0 else f"{span[0]:,.0f} to {span[1]:,.0f} ({span[1] / span[0]:.2f}x)"


def read(workdir) -> tuple[list[dict], float]:
  """The run's curve (its cool-downs' evaluations and its final one) and its corpus's bits of facts per entity."""
  from moc_jax.config import load_run_config
  from moc_jax.data.facts import fact_bits
  from moc_jax.train.cooldown import SPLIT
  config = load_run_config(workdir)
  facts, steps = config.data.facts, config.train.steps
  rows = [r for r in read_metrics(workdir) if r.get("split") == SPLIT and "probe_acc" in r]
  rows += [final] if (final := final_eval(workdir, steps)) else []
  if not rows:
    raise UsageError(f"--run={workdir}: no cool-down or final evaluation with probes yet; give a run with "
                     "train.cooldowns (e.g. '--config.train.cooldowns=(0.125,0.25,0.5)') once one has ended")
  bits = fact_bits(facts)
  return curve(rows, steps, facts.num_docs / facts.num_entities, bits["total"]), bits["per_entity"]


@cli.exit_on_error
def main(argv=None) -> list[str]:
  args = cli.parse_command(_FLAGS, argv)
  if not args.run or not os.path.isfile(os.path.join(args.run, "config.json")):
    raise UsageError(f"--run={args.run or ''}: give a training run's directory (it holds config.json), e.g. "
                     "--run=runs/plateau-n16-e6144/r1600")
  lines = table(*read(args.run))
  print("\n".join(lines))
  return lines


if __name__ == "__main__":
  main()
