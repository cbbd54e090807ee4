"""What a sweep's runs reached (`python launch/collect.py sweeps/<name>`): per run the final validation CE,
fact recall, router health, training FLOPs (moc_jax/flops.py on the run's config.json), parameters total /
active, tokens and wall time, as results.csv and results.md; runs that differ only in their seed as mean ±
standard error (seeds.csv and results.md), with the fact recall per bucket of how many training documents
name the entity where `python -m moc_jax.eval` wrote an eval.json (results.md); power-law fits of the loss
against training compute, bank size (at fixed compute) and top-k (at fixed bank); loss_vs_*.png. A run without
its final evaluation is listed as failed or unfinished and kept out of the fits, never dropped.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import json
import math
import os
import re

import numpy as np

from experiments.sweeps.plan import BANK_KEYS, compute, is_moc, run_name
from experiments.sweeps.runs import LOG, MANIFEST, final_eval, read_manifest, read_metrics
from moc_jax.config.plan import bank_ids, bank_shape

CONFIDENCE = 0.95
COLUMNS = ("run", "status", "kind", "top_k", "bank_tokens", "steps", "tokens", "train_flops", "flops_per_token",
           "params_total", "params_active", "val_ce", "fact_recall", "exact_match", "router_used_frac",
           "router_shared_mass", "eval_used_frac", "eval_max_load", "paraphrase_jaccard", "other_entity_jaccard",
           "recall_without_bank", "wall_s", "note")
SEED_METRICS = ("val_ce", "fact_recall", "exact_match", "router_used_frac", "router_shared_mass", "eval_used_frac",
                "eval_max_load", "paraphrase_jaccard", "other_entity_jaccard", "recall_without_bank")
SEED_HEADERS = ("val CE", "fact recall", "exact match", "chapters read (train window)", "shared-chapter mass",
                "chapters / slots read (eval)", "max / mean load (eval)", "Jaccard paraphrase", "Jaccard other entity",
                "recall without the bank")
# (fit, x column, the override keys that vary along it, x-axis label); compute is fitted per kind of model.
FITS = (("compute", "train_flops", None, "training FLOPs (model FLOPs, forward + backward)"),
        ("bank", "bank_tokens", BANK_KEYS, "bank tokens"),
        ("top_k", "top_k", ("memory.top_k",), "top-k (routed chapters read)"))


@dataclasses.dataclass(frozen=True)
class PowerLaw:
  """y = a·x^b; [b_low, b_high] is the CONFIDENCE interval of b."""
  a: float
  b: float
  b_low: float
  b_high: float
  r2: float
  n: int

  def __call__(self, x):
    return self.a * np.asarray(x, np.float64) ** self.b


def fit_power_law(x, y, confidence=CONFIDENCE) -> PowerLaw:
  """Least squares of log y = log a + b·log x. The interval of b is Student's t with n − 2 degrees of
  freedom (nan for two points: a line through two points has no residual to measure)."""
  from scipy import stats
  lx, ly = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
  n = len(lx)
  if n < 2 or np.ptp(lx) == 0:
    raise ValueError(f"a power law needs two distinct x values, got {list(x)}")
  sxx = np.sum((lx - lx.mean()) ** 2)
  b = np.sum((lx - lx.mean()) * (ly - ly.mean())) / sxx
  log_a = ly.mean() - b * lx.mean()
  rss = float(np.sum((ly - log_a - b * lx) ** 2))
  tss = float(np.sum((ly - ly.mean()) ** 2))
  half = stats.t.ppf((1 + confidence) / 2, n - 2) * math.sqrt(rss / (n - 2) / sxx) if n > 2 else math.nan
  return PowerLaw(float(np.exp(log_a)), float(b), float(b - half), float(b + half),
                  1 - rss / tss if tss > 0 else math.nan, n)


# ---- one row per run --------------------------------------------------------------------------------

def run_rows(sweep_dir: str) -> list[dict]:
  entries = read_manifest(sweep_dir)
  if not entries:
    raise FileNotFoundError(f"{os.path.join(sweep_dir, MANIFEST)} not found or empty: pass a directory "
                            "that launch/sweep.py wrote")
  return [_row(sweep_dir, e) for e in entries]


def _row(sweep_dir, entry):
  from moc_jax import count_params
  from moc_jax.config import load_run_config
  workdir = os.path.join(sweep_dir, entry["name"])
  row = {"run": entry["name"], "status": entry.get("status", "pending"), "wall_s": entry.get("wall_s"),
         "overrides": entry.get("overrides", {}), "returncode": entry.get("returncode"), "workdir": workdir}

  def unfinished(note):  # the manifest's status stands, except a "done" without the final evaluation
    return {**row, "status": "failed" if row["status"] == "done" else row["status"], "note": note}

  if not os.path.isfile(os.path.join(workdir, "config.json")):
    return unfinished("no config.json")
  config = load_run_config(workdir)
  mem, steps = config.memory, config.train.steps
  counts = count_params(config)
  row.update(kind=run_kind(config), steps=steps, **compute(config), params_total=counts["total"],
             params_active=counts["total"] - counts["bank"] + bank_read(config, counts["bank"]))
  if row["kind"] == "moc":
    row.update(top_k=mem.top_k, bank_tokens=mem.num_tokens)
  final = final_eval(workdir, steps)
  if final is None:
    reached = max((r["step"] for r in read_metrics(workdir) if "split" not in r), default=0)
    return unfinished(f"reached step {reached} of {steps}")
  return {**row, "status": "done", "val_ce": final["ce"], "fact_recall": final.get("probe_acc"),
          "exact_match": final.get("probe_exact"), **_router_health(workdir), **_eval_routing(workdir),
          **_recall_by_docs(workdir)}


def run_kind(config) -> str:
  """`moc` (the chapter memory), `pkm` or `hml` (memory.kind), or `dense` (no memory layer): the compute fit is
  made per kind, and the bank and top-k fits take `moc` runs alone."""
  if not is_moc(config):
    return "dense"
  return "moc" if config.memory.kind == "chapters" else config.memory.kind


def bank_read(config, bank: int) -> int:
  """The parameters of the bank (`bank` of them, count_params's) that one read covers. chapters: the shared and
  top-k chapters of a sequence, (shared + k) / C of the bank. pkm / hml: the value rows one token reads, heads x
  pkm_top_k in each memory layer (pkm_heads for pkm, the attention heads for hml), at most a table's N rows
  per table."""
  mem = config.memory
  if mem.kind == "chapters":
    return bank * (mem.num_shared + mem.top_k) // mem.num_chapters
  shape = bank_shape(config)
  heads = mem.pkm_heads if mem.kind == "pkm" else config.model.num_heads
  readers = collections.Counter(bank_ids(config))  # memory layers per table
  rows = sum(min(shape.rows, n * heads * mem.pkm_top_k) for n in readers.values())
  return bank * rows // (shape.tables * shape.rows)


def _router_health(workdir) -> dict:
  """The last training log row's router health, averaged over memory layers: the share of routable chapters
  read in its window, and the router probability on the shared chapters."""
  train = [r for r in read_metrics(workdir) if "split" not in r]
  out = {}
  for key in ("router_used_frac", "router_shared_mass"):
    values = [v for k, v in (train[-1] if train else {}).items() if k.startswith(key + "_L")]
    if values:
      out[key] = float(np.mean(values))
  return out


def eval_report(workdir) -> dict:
  """WORKDIR/eval.json as `python -m moc_jax.eval --workdir=WORKDIR` wrote it; {} when there is none."""
  path = os.path.join(workdir, "eval.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _eval_routing(workdir) -> dict:
  """From WORKDIR/eval.json, when `python -m moc_jax.eval --workdir=WORKDIR` wrote one: routing over the
  evaluation split averaged over memory layers (chapters ever read, max/mean load) and the stability of fact
  prompts' chapters (Jaccard overlap with a paraphrase and with another entity); with `--ablate_chapters=routed`,
  the fact recall with every routable chapter zeroed (how much of the recall the bank holds)."""
  report = eval_report(workdir)
  routing = report.get("routing") or {}
  layers, stability = routing.get("layers", []), routing.get("stability", [])
  out = {}
  for key, rows, fields in (("eval_used_frac", layers, ("chapters_selected_frac", "slots_selected_frac")),
                            ("eval_max_load", layers, ("max_load",)),
                            ("paraphrase_jaccard", stability, ("paraphrase_jaccard",)),
                            ("other_entity_jaccard", stability, ("other_entity_jaccard",))):
    values = [r[field] for r in rows for field in fields if field in r]
    if values:
      out[key] = float(np.mean(values))
  ablation = report.get("ablation") or {}
  if ablation.get("spec") == "routed" and "fact_recall" in ablation:
    out["recall_without_bank"] = ablation["fact_recall"]["probe_acc"]
  return out


def _recall_by_docs(workdir) -> dict:
  """From WORKDIR/eval.json: {"recall_by_docs": {bucket: recall}}, the fact recall per bucket of the entity's
  training-document count ("10-29", "1000+"; `moc_jax.eval --bucket_edges`), and with `--ablate_chapters=routed`
  the same with every routable chapter zeroed ("recall_by_docs_without_bank"); {} without an evaluation. The
  training log scores a sample of all probes; this is where a run's recall of rare entities shows."""
  report = eval_report(workdir)
  ablation = report.get("ablation") or {}
  sources = {"recall_by_docs": report.get("fact_recall"),
             "recall_by_docs_without_bank": ablation.get("fact_recall") if ablation.get("spec") == "routed" else None}
  return {key: {b["docs"]: b["acc"] for b in recall["buckets"]}
          for key, recall in sources.items() if recall and recall.get("buckets")}


def _min_docs(bucket: str) -> int:
  """A bucket label's lower edge: "10-29" -> 10, "1000+" -> 1000."""
  return int(re.match(r"\d+", bucket).group())


def mean_and_se(values) -> tuple[float, float]:
  """Mean and standard error (sample standard deviation / sqrt(n); NaN for one value) of per-seed results."""
  v = np.asarray(values, np.float64)
  return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def welch_t(a, b) -> tuple[float, float]:
  """Welch's t of mean(a) - mean(b) and its degrees of freedom (infinite or NaN when neither sample varies)."""
  from scipy import stats
  result = stats.ttest_ind(a, b, equal_var=False)
  return float(result.statistic), float(result.df)


def seed_groups(rows) -> list[dict]:
  """Finished runs that differ only in their seed (`<point>-seed<N>`), as one row per point: n and, for each
  SEED_METRICS column, the mean and standard error over seeds (sample standard deviation / sqrt(n))."""
  groups = {}
  for r in rows:
    if r["status"] == "done" and re.search(r"-seed\d+$", r["run"]):
      groups.setdefault(re.sub(r"-seed\d+$", "", r["run"]), []).append(r)
  out = []
  for name, members in groups.items():
    row = {"point": name, "n": len(members), "kind": members[0]["kind"]}
    for key in SEED_METRICS:
      values = [m[key] for m in members if m.get(key) is not None]
      if values:
        row[key], row[key + "_se"] = mean_and_se(values)
    for key in ("recall_by_docs", "recall_by_docs_without_bank"):
      by_docs = {}
      for m in members:  # a bucket can be empty in some runs (their corpora or --bucket_edges differ)
        for bucket, recall in m.get(key, {}).items():
          by_docs.setdefault(bucket, []).append(recall)
      if by_docs:
        row[key] = {b: (*mean_and_se(by_docs[b]), len(by_docs[b])) for b in sorted(by_docs, key=_min_docs)}
    out.append(row)
  return out


# ---- fits -------------------------------------------------------------------------------------------

def fits(rows) -> list[dict]:
  """Every fit with two or more distinct x values. Compute: all finished runs of a kind. Bank / top-k:
  finished MoC runs whose overrides are equal but for the bank (the same k·T and steps: fixed compute up
  to the router's width) / the top-k; `compute_spread` is the group's largest / smallest FLOPs − 1."""
  done = [r for r in rows if r["status"] == "done"]
  out = []
  for fit, x, keys, _ in FITS:
    groups = {}
    for r in done:
      if keys is None:
        groups.setdefault(r["kind"], []).append(r)
      elif r["kind"] == "moc":
        fixed = {k: v for k, v in r["overrides"].items() if k not in keys}
        groups.setdefault(run_name(fixed), []).append(r)
    for group, members in groups.items():
      if len({r[x] for r in members}) < 2:
        continue
      law = fit_power_law([r[x] for r in members], [r["val_ce"] for r in members])
      flops = [r["train_flops"] for r in members]
      out.append({"fit": fit, "x": x, "group": group, "runs": [r["run"] for r in members], "law": law,
                  "compute_spread": max(flops) / min(flops) - 1})
  return out


# ---- outputs ----------------------------------------------------------------------------------------

def _cell(key, value):
  if value is None or value == "":
    return ""
  if key in ("train_flops",):
    return f"{value:.3g}"
  if key in ("tokens", "params_total", "params_active", "flops_per_token", "bank_tokens"):
    return f"{value:,.0f}"
  if key == "val_ce":
    return f"{value:.4f}"
  if key in ("fact_recall", "exact_match", "router_used_frac", "router_shared_mass", "eval_used_frac", "eval_max_load",
             "paraphrase_jaccard", "other_entity_jaccard", "recall_without_bank"):
    return f"{value:.3f}"
  if key == "wall_s":
    return f"{value:.0f}"
  return str(value)


def _mean_se(group, key):
  if key not in group:
    return ""
  digits, se = 4 if key == "val_ce" else 3, group[key + "_se"]
  return f"{group[key]:.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")  # one seed: no spread


def seed_table(groups) -> list[str]:
  """The lines of a markdown table of seed_groups: one row per point, mean ± standard error of each metric."""
  lines = ["| point | kind | seeds | " + " | ".join(SEED_HEADERS) + " |", "|---|---|---:|" + "---:|" * len(SEED_HEADERS)]
  return lines + [f"| {g['point']} | {g['kind']} | {g['n']} | " + " | ".join(_mean_se(g, k) for k in SEED_METRICS)
                  + " |" for g in groups]


def recall_by_docs_table(groups) -> list[str]:
  """The lines of a markdown table of seed_groups' fact recall per bucket of the entity's training documents
  (mean ± standard error over the seeds with an entity in the bucket; their number is shown when some seed has
  none), then, for points evaluated with `--ablate_chapters=routed`, the same with the routable bank zeroed;
  [] when no point has an evaluation."""
  rows = [(g["point"], g["n"], g["recall_by_docs"]) for g in groups if g.get("recall_by_docs")]
  rows += [(f"{g['point']}, routable bank zeroed", g["n"], g["recall_by_docs_without_bank"])
           for g in groups if g.get("recall_by_docs_without_bank")]
  if not rows:
    return []
  buckets = sorted({b for _, _, by_docs in rows for b in by_docs}, key=_min_docs)

  def cell(by_docs, n_seeds, bucket):
    if bucket not in by_docs:
      return ""
    mean, se, n = by_docs[bucket]
    seeds = "" if n == n_seeds else f" ({n} of {n_seeds} seeds)"
    return f"{mean:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}") + seeds

  header = ["| point | seeds | " + " | ".join(f"{b} docs" for b in buckets) + " |",
            "|---|---:|" + "---:|" * len(buckets)]
  return header + [f"| {point} | {n} | " + " | ".join(cell(by_docs, n, b) for b in buckets) + " |"
                   for point, n, by_docs in rows]


def markdown(title, rows, fit_list, plots) -> str:
  header = ("run", "status", "kind", "top-k", "bank tokens", "steps", "tokens", "training FLOPs", "FLOPs/token",
            "params total", "params active", "val CE", "fact recall", "exact match", "chapters read",
            "shared-chapter mass", "chapters / slots read (eval)", "max / mean load (eval)", "Jaccard paraphrase",
            "Jaccard other entity", "recall without the bank", "wall s")
  lines = [f"# {title}", "", f"{len(rows)} runs, {sum(r['status'] == 'done' for r in rows)} finished. Validation CE "
           "(nats/token) and fact recall (likelihood choice; exact match: greedy) at the last step; training FLOPs "
           "= the estimator's model FLOPs per token (forward + backward, memory as read) x tokens; active "
           "parameters count the bank's read chapters only (pkm, hml: the value rows one token reads).", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
  lines += ["| " + " | ".join(_cell(k, r.get(k)) for k in COLUMNS[:-1]) + " |" for r in rows]
  groups = seed_groups(rows)
  if groups:
    lines += ["", "## Across seeds (mean ± standard error over seeds)", "", *seed_table(groups)]
    by_docs = recall_by_docs_table(groups)
    if by_docs:
      lines += ["", "## Fact recall by how many training documents name the entity (`python -m moc_jax.eval`; "
                "mean ± standard error over seeds)", "", *by_docs]
  lines += ["", f"## Fits: loss = a·x^b (least squares in log-log; {CONFIDENCE:.0%} interval of b from Student's t)",
            ""]
  if fit_list:
    lines += ["| loss against | at | runs | b | interval of b | a | R² | compute spread |",
              "|---|---|---:|---:|---|---:|---:|---:|"]
    for f in fit_list:
      law = f["law"]
      interval = "n/a (2 runs)" if math.isnan(law.b_low) else f"[{law.b_low:.4f}, {law.b_high:.4f}]"
      lines.append(f"| {f['fit']} | {f['group']} | {law.n} | {law.b:.4f} | {interval} | {law.a:.4g} | "
                   f"{law.r2:.3f} | {f['compute_spread']:.2%} |")
  else:
    lines.append("No fit: no group of finished runs has two distinct values of compute, bank or top-k.")
  failed = [r for r in rows if r["status"] != "done"]
  lines += ["", "## Failed or unfinished runs (kept out of the fits)", ""]
  lines += [f"- {r['run']}: {r['status']}" + (f", exit {r['returncode']}" if r.get("returncode") else "")
            + (f", {r['note']}" if r.get("note") else "") + f"; log {os.path.join(r['workdir'], LOG)}"
            for r in failed] or ["None."]
  if plots:
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
  return "\n".join(lines) + "\n"


def plot(rows, fit_list, out_dir) -> list[str]:
  """loss_vs_<fit>.png for each fit that has at least one group: points and fitted lines, log-log."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib import ticker
  names = []
  for fit, x, _, label in FITS:
    chosen = [f for f in fit_list if f["fit"] == fit]
    if not chosen:
      continue
    fig, ax = plt.subplots(figsize=(6, 4))
    for f in chosen:
      members = [r for r in rows if r["run"] in f["runs"]]
      xs = np.array(sorted(r[x] for r in members), np.float64)
      law = f["law"]
      interval = "" if math.isnan(law.b_low) else f" [{law.b_low:.3f}, {law.b_high:.3f}]"
      dots = ax.plot([r[x] for r in members], [r["val_ce"] for r in members], "o")[0]
      ax.plot(xs, law(xs), "--", color=dots.get_color(), label=f"{f['group']}: b = {law.b:.3f}{interval}")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))  # plain numbers, not powers of 10
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    if fit != "compute":  # a tick at each bank size / top-k run
      ax.set_xticks(sorted({r[x] for r in rows if any(r["run"] in f["runs"] for f in chosen)}))
      ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
      ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel(label), ax.set_ylabel("final validation CE (nats/token)")
    ax.legend(fontsize=7), ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    names.append(f"loss_vs_{fit}.png")
    fig.savefig(os.path.join(out_dir, names[-1]), dpi=100)
    plt.close(fig)
  return names


def write_csv(rows, path) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS} for r in rows)


def collect(sweep_dir: str, out_dir: str | None = None) -> str:
  """Writes results.csv, results.md and the plots into out_dir (default sweep_dir); returns the markdown."""
  out_dir = out_dir or sweep_dir
  os.makedirs(out_dir, exist_ok=True)
  rows = run_rows(sweep_dir)
  fit_list = fits(rows)
  entry = read_manifest(sweep_dir)[0]
  title = f"Sweep {os.path.basename(os.path.normpath(sweep_dir))}"
  if "config" in entry:
    title += f": `--config={entry['config']} --sweep={entry['sweep']}`"
  write_csv(rows, os.path.join(out_dir, "results.csv"))
  groups = seed_groups(rows)
  if groups:
    with open(os.path.join(out_dir, "seeds.csv"), "w", newline="") as f:
      writer = csv.DictWriter(f, ["point", "kind", "n", *(k + s for k in SEED_METRICS for s in ("", "_se"))],
                              extrasaction="ignore")
      writer.writeheader()
      writer.writerows(groups)
  text = markdown(title, rows, fit_list, plot(rows, fit_list, out_dir))
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(text)
  return text
