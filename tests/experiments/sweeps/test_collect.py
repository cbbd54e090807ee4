"""launch/collect.py (moc_jax/report.py) on synthetic sweeps: run directories as training writes them
(config.json, metrics.jsonl) whose final losses follow known power laws; the fits recover the exponents,
failed and unstarted runs are listed, and the CSV, markdown and plots are written."""
import csv
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import moc_jax
from experiments.sweeps import report as sweep_report
from experiments.sweeps.plan import compute, plan
from experiments.sweeps.runs import write_manifest

ROOT = Path(__file__).resolve().parents[3]


def make_sweep(sweep_dir, spec, sweep, loss, only=None, failed=(), unstarted=()):
  """Writes what launch/sweep.py and the runs would: per point config.json and metrics.jsonl whose last
  validation CE is loss(row) (row: train_flops, top_k, bank_tokens); `failed` points stop at step 1 with
  exit 1, `unstarted` ones never ran."""
  entries = []
  for p in plan(spec, sweep, only=only):
    workdir = os.path.join(sweep_dir, p.name)
    steps = p.config.train.steps
    entry = {"name": p.name, "overrides": p.overrides, "workdir": workdir, "command": "", "status": "done",
             "returncode": 0, "wall_s": 10.0, "attempts": 1, "steps": steps, "config": spec, "sweep": sweep}
    entries.append(entry)
    if p.name in unstarted:
      entry.update(status="pending", returncode=None, wall_s=0.0, attempts=0)
      continue
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(p.config.to_json_best_effort(indent=2, sort_keys=True))
    rows = [{"step": 0, "split": "validation", "ce": 5.5}, {"step": 1, "loss": 5.0, "ce": 5.0}]
    if p.name in failed:
      entry.update(status="failed", returncode=1)
    else:
      mem = p.config.memory
      x = {**compute(p.config), "top_k": mem.top_k, "bank_tokens": mem.num_tokens}
      rows.append({"step": steps, "split": "validation", "ce": loss(x), "probe_acc": 0.3, "probe_exact": 0.1})
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  write_manifest(sweep_dir, entries)


def test_power_law_exact_and_interval():
  x = np.array([1e12, 3e12, 1e13, 3e13, 1e14])
  law = sweep_report.fit_power_law(x, 7.0 * x ** -0.05)
  assert law.b == pytest.approx(-0.05, abs=1e-12) and law.a == pytest.approx(7.0, rel=1e-9)
  assert law.b_high - law.b_low == pytest.approx(0, abs=1e-9) and law.r2 == pytest.approx(1.0)
  # The interval is the textbook one: slope standard error x Student's t with n - 2 degrees of freedom.
  y = 7.0 * x ** -0.05 * np.exp([0.01, -0.02, 0.015, 0.0, -0.01])
  law, ref = sweep_report.fit_power_law(x, y), stats.linregress(np.log(x), np.log(y))
  half = stats.t.ppf(0.975, 3) * ref.stderr
  assert (law.b, law.b_low, law.b_high) == pytest.approx((ref.slope, ref.slope - half, ref.slope + half), rel=1e-9)
  assert math.isnan(sweep_report.fit_power_law(x[:2], y[:2]).b_low)  # two points: no interval
  with pytest.raises(ValueError):
    sweep_report.fit_power_law([3.0, 3.0], [1.0, 2.0])


def test_noisy_power_law_interval_covers_the_exponent():
  rng = np.random.default_rng(0)
  covered = 0
  for _ in range(200):
    x = np.geomspace(1e12, 1e15, 12)
    law = sweep_report.fit_power_law(x, 4.0 * x ** -0.08 * np.exp(rng.normal(0, 0.02, x.size)))
    assert abs(law.b + 0.08) < 0.02
    covered += law.b_low <= -0.08 <= law.b_high
  assert 0.9 <= covered / 200 <= 0.99  # a 95% interval


def test_collect_recovers_known_exponents_and_lists_failures(tmp_path):
  """topk x bank grid with loss = 3·k^-0.1·bank^-0.03 exactly: every top-k fit (at a fixed bank) recovers
  -0.1 and every bank fit (at a fixed k) -0.03; one failed and one unstarted run are listed, not fitted."""
  sweep_dir = str(tmp_path / "grid")
  only = [f"k{k}-bank{b}" for k in (1, 4, 8) for b in (144, 528, 1040)]
  make_sweep(sweep_dir, "configs/moc.py:tiny", "topk_bank",
             lambda r: 3.0 * r["top_k"] ** -0.1 * r["bank_tokens"] ** -0.03, only=[*only, "k2-bank144", "k2-bank528"],
             failed=["k2-bank144"], unstarted=["k2-bank528"])
  out = tmp_path / "report"
  text = sweep_report.collect(sweep_dir, str(out))
  rows = {r["run"]: r for r in csv.DictReader(open(out / "results.csv"))}
  assert len(rows) == 11 and rows["k2-bank144"]["status"] == "failed" and rows["k2-bank528"]["status"] == "pending"
  assert rows["k2-bank144"]["val_ce"] == "" and rows["k8-bank528"]["status"] == "done"
  assert float(rows["k8-bank528"]["val_ce"]) == pytest.approx(3.0 * 8 ** -0.1 * 528 ** -0.03)
  fits = {(f["fit"], f["group"]): f for f in sweep_report.fits(sweep_report.run_rows(sweep_dir))}
  for bank in (144, 528, 1040):
    law = fits[("top_k", f"bank{bank}")]["law"]
    assert law.n == 3 and law.b == pytest.approx(-0.1, abs=1e-9)
  train_flops = {p.name: compute(p.config)["train_flops"] for p in plan("configs/moc.py:tiny", "topk_bank", only=only)}
  for k in (1, 4, 8):
    assert fits[("bank", f"k{k}")]["law"].b == pytest.approx(-0.03, abs=1e-9)
    group = [train_flops[f"k{k}-bank{b}"] for b in (144, 528, 1040)]  # a bigger bank: a wider router, more projected
    assert fits[("bank", f"k{k}")]["compute_spread"] == pytest.approx(max(group) / min(group) - 1, rel=1e-12)
  assert "k2-bank144" not in fits[("compute", "moc")]["runs"] and fits[("compute", "moc")]["law"].n == 9
  assert "- k2-bank144: failed, exit 1, reached step 1 of 900; log" in text
  assert "- k2-bank528: pending, no config.json; log" in text
  assert "| top_k | bank528 | 3 | -0.1000 |" in text
  assert {p.name for p in out.iterdir()} == {"results.csv", "results.md", "loss_vs_compute.png", "loss_vs_bank.png",
                                             "loss_vs_top_k.png"}
  assert (out / "results.md").read_text() == text


def test_collect_compute_fit_and_parameters(tmp_path):
  """The demo grid (steps x (banks + backbone)) with loss = 9·C^-0.06 exactly in training FLOPs C, as the estimator counts
  them on each run's config.json; parameters as count_params; the CLI prints the same table."""
  sweep_dir = str(tmp_path / "demo")
  make_sweep(sweep_dir, "configs/moc.py:tiny", "demo", lambda r: 9.0 * r["train_flops"] ** -0.06)
  rows = {r["run"]: r for r in sweep_report.run_rows(sweep_dir)}
  laws = {f["group"]: f["law"] for f in sweep_report.fits(list(rows.values())) if f["fit"] == "compute"}
  assert (laws["moc"].n, laws["dense"].n) == (9, 3)  # the demo's backbone runs are fitted on their own
  for law in laws.values():
    assert law.b == pytest.approx(-0.06, abs=1e-9) and law.b_high - law.b_low < 1e-9
  row = rows["bank528-steps112"]
  config = moc_jax.load_config("configs/moc.py:tiny", {"memory.num_tokens": 528, "memory.num_chapters": 33,
                                                       "train.steps": 112})
  counts = moc_jax.count_params(config)
  assert row["tokens"] == 112 * 32 * 128 and row["params_total"] == counts["total"]
  assert row["params_active"] == counts["total"] - counts["bank"] + (1 + 8) * 16 * 64  # 9 chapters read of 16 x d 64
  assert row["train_flops"] == pytest.approx(moc_jax.flops.model_flops_per_token(config) * 112 * 32 * 128)
  spec = importlib.util.spec_from_file_location("collect_cli", ROOT / "launch" / "collect.py")
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  assert cli.main([sweep_dir]) == 0
  assert (Path(sweep_dir) / "loss_vs_compute.png").stat().st_size > 1000
  assert cli.main([str(tmp_path / "nothing")]) == 2


def test_collect_iso_flop_fits_each_kind(tmp_path):
  """Vanilla runs (memory off) are `dense`, with no top-k or bank and all their parameters active; the
  compute law is fitted per kind."""
  sweep_dir = str(tmp_path / "iso")
  configs = {p.name: p.config for p in plan("configs/moc.py:tiny", "iso_flop")}
  per_token = {n: compute(c)["flops_per_token"] for n, c in configs.items()}
  vanillas = [n for n in configs if n.startswith("dense-")]
  iso1, iso64 = (min(vanillas, key=lambda n, k=k: abs(per_token[n] - per_token[k])) for k in ("k1", "k64"))
  make_sweep(sweep_dir, "configs/moc.py:tiny", "iso_flop", lambda r: 2.0 * r["train_flops"] ** -0.02,
             only=["dense", "k1", iso1, "k64", iso64])
  rows = {r["run"]: r for r in sweep_report.run_rows(sweep_dir)}
  assert {n: r["kind"] for n, r in rows.items()} == {"dense": "dense", "k1": "moc", iso1: "dense",
                                                     "k64": "moc", iso64: "dense"}
  assert "top_k" not in rows["dense"] and rows["dense"]["params_active"] == rows["dense"]["params_total"]
  wider = configs[iso64].copy_and_resolve_references()  # FLOPs are linear in the width: one step of 16 columns
  wider.model.mlp_dim += 16
  half_step = (compute(wider)["flops_per_token"] - per_token[iso64]) / 2
  assert abs(rows[iso64]["flops_per_token"] - rows["k64"]["flops_per_token"]) <= half_step
  laws = {f["group"]: f["law"] for f in sweep_report.fits(list(rows.values())) if f["fit"] == "compute"}
  assert laws["moc"].n == 2 and laws["dense"].n == 3 and laws["dense"].b == pytest.approx(-0.02, abs=1e-9)


def test_collect_averages_seeds_with_standard_errors(tmp_path):
  """The routing sweep's points once per seed: one row per point with the mean and the standard error over
  seeds (sample std / sqrt(n)) of CE, recall and router health (from the last training row)."""
  sweep_dir = str(tmp_path / "routing")
  only = [f"{arm}-seed{s}" for arm in ("dense", "aux_free-segment") for s in (0, 1, 2)]
  make_sweep(sweep_dir, "configs/moc.py:tiny", "routing", lambda r: 1.0, only=only)
  for i, name in enumerate(only):  # CE 1.0 + seed/10; router health on the memory runs
    path = os.path.join(sweep_dir, name, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    rows[-1]["ce"] = 1.0 + (i % 3) / 10
    rows.insert(-1, {"step": 899, "loss": 1.0, "ce": 1.0, **({"router_used_frac_L1": 0.5 + (i % 3) / 10,
                                                              "router_used_frac_L3": 0.7 + (i % 3) / 10}
                                                             if "aux_free" in name else {})})
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    if "aux_free" in name:  # what `python -m moc_jax.eval --workdir=...` writes
      with open(os.path.join(sweep_dir, name, "eval.json"), "w") as f:
        json.dump({"routing": {"layers": [{"chapters_selected_frac": 0.9, "max_load": 2.0},
                                          {"chapters_selected_frac": 0.7, "max_load": 3.0}],
                               "stability": [{"paraphrase_jaccard": 0.5, "other_entity_jaccard": 0.25 + i / 100},
                                             {"paraphrase_jaccard": 0.3, "other_entity_jaccard": 0.25}]},
                   "ablation": {"spec": "routed", "fact_recall": {"probe_acc": 0.5 - i / 100}}}, f)
  text = sweep_report.collect(sweep_dir, str(tmp_path / "out"))
  groups = {g["point"]: g for g in csv.DictReader(open(tmp_path / "out" / "seeds.csv"))}
  af = groups["aux_free-segment"]
  assert [float(af[k]) for k in ("eval_used_frac", "eval_max_load", "paraphrase_jaccard")] == pytest.approx([0.8, 2.5, 0.4])
  assert float(af["other_entity_jaccard"]) == pytest.approx(0.25 + 0.04 / 2)  # i = 3, 4, 5 on the first layer
  assert float(af["recall_without_bank"]) == pytest.approx(0.5 - 0.04)  # the `routed` ablation's recall
  assert groups["dense"]["recall_without_bank"] == ""
  assert set(groups) == {"dense", "aux_free-segment"} and groups["dense"]["n"] == "3"
  se = np.std([1.0, 1.1, 1.2], ddof=1) / math.sqrt(3)
  assert float(groups["dense"]["val_ce"]) == pytest.approx(1.1) and float(groups["dense"]["val_ce_se"]) == pytest.approx(se)
  assert float(groups["aux_free-segment"]["router_used_frac"]) == pytest.approx(0.7)  # layers then seeds
  assert groups["dense"]["router_used_frac"] == ""
  assert f"| aux_free-segment | moc | 3 | 1.1000 ± {se:.4f} | 0.300 ± 0.000 |" in text


def test_collect_recall_by_entity_documents_across_seeds(tmp_path):
  """Each run's eval.json buckets (recall by the entity's training documents) averaged per point over the
  seeds with an entity in the bucket, the lower edges in order, the seed count shown where a seed has none; a
  point evaluated with the routable bank zeroed gets a second row."""
  sweep_dir = str(tmp_path / "routing")
  only = [f"{arm}-seed{s}" for arm in ("dense", "routed-prefix") for s in (0, 1, 2)]
  make_sweep(sweep_dir, "configs/moc.py:tiny", "routing", lambda r: 1.0, only=only)
  recalls = {"dense": ([0.30, 0.36, 0.33], [0.9, 1.0, None]), "routed-prefix": ([0.40, 0.50, 0.45], [1.0, 1.0, 1.0])}
  for arm, (rare, common) in recalls.items():
    for s in range(3):
      buckets = [{"docs": "10-29", "min_docs": 10, "acc": rare[s]}]
      buckets += [] if common[s] is None else [{"docs": "100-299", "min_docs": 100, "acc": common[s]}]
      buckets.reverse()  # out of order: the table orders by lower edge
      report = {"fact_recall": {"probe_acc": 0.5, "buckets": buckets}}
      if arm == "routed-prefix":  # `--ablate_chapters=routed`: each bucket's recall falls by 0.1 * (seed + 1)
        zeroed = [{**b, "acc": b["acc"] - 0.1 * (s + 1)} for b in buckets]
        report["ablation"] = {"spec": "routed", "fact_recall": {"probe_acc": 0.4, "buckets": zeroed}}
      with open(os.path.join(sweep_dir, f"{arm}-seed{s}", "eval.json"), "w") as f:
        json.dump(report, f)
  text = sweep_report.collect(sweep_dir, str(tmp_path / "out"))
  se = lambda v: np.std(v, ddof=1) / math.sqrt(len(v))
  lines = text.splitlines()
  header = lines.index("| point | seeds | 10-29 docs | 100-299 docs |")
  assert f"| dense | 3 | 0.330 ± {se([0.30, 0.36, 0.33]):.3f} | 0.950 ± {se([0.9, 1.0]):.3f} (2 of 3 seeds) |" in (
      lines[header + 2:header + 4])
  assert f"| routed-prefix | 3 | 0.450 ± {se([0.40, 0.50, 0.45]):.3f} | 1.000 ± 0.000 |" in (
      lines[header + 2:header + 4])
  assert lines[header + 4] == (f"| routed-prefix, routable bank zeroed | 3 | 0.250 ± {se([0.30, 0.30, 0.15]):.3f} | "
                               f"0.800 ± {se([0.9, 0.8, 0.7]):.3f} |")
  assert "recall_by_docs" not in open(tmp_path / "out" / "seeds.csv").readline()
  os.remove(os.path.join(sweep_dir, "dense-seed0", "eval.json"))  # without every seed's evaluation, still a row
  text = sweep_report.collect(sweep_dir, str(tmp_path / "o2"))
  assert "| dense | 3 | 0.345 ± 0.015 (2 of 3 seeds) | 1.000 (1 of 3 seeds) |" in text


def test_collect_memory_kinds(tmp_path):
  """The `kinds` sweep: pkm and hml runs are kinds of their own (the compute law is never fitted across memory
  kinds), their active parameters count the value rows one token reads (heads x pkm_top_k per memory layer, not
  the chapters' (shared + k) / C), and the slots an evaluation saw read fill the eval column."""
  sweep_dir = str(tmp_path / "kinds")
  only = [f"{point}-seed{s}" for point in ("kindchapters", "kindpkm", "kindhml", "dense") for s in (0, 1, 2)]
  make_sweep(sweep_dir, "configs/moc.py:tiny", "kinds", lambda r: 1.0 + r["train_flops"] * 1e-14, only=only)
  for s in range(3):  # what `python -m moc_jax.eval --workdir=... --ablate_chapters=routed` writes for pkm
    with open(os.path.join(sweep_dir, f"kindpkm-seed{s}", "eval.json"), "w") as f:
      json.dump({"routing": {"kind": "pkm", "layers": [{"slots_selected_frac": 0.25, "max_load": 4.0},
                                                       {"slots_selected_frac": 0.75, "max_load": 2.0}]},
                 "ablation": {"spec": "routed", "fact_recall": {"probe_acc": 0.25}}}, f)
  rows = {r["run"]: r for r in sweep_report.run_rows(sweep_dir)}
  assert {n[:-6]: r["kind"] for n, r in rows.items()} == {"kindchapters": "moc", "kindpkm": "pkm", "kindhml": "hml",
                                                          "dense": "dense"}
  tiny = lambda kind: moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": kind})
  for kind, row_width in (("pkm", 64), ("hml", 64 // 4)):  # pkm: d_model-wide values; hml: a head's width
    counts = moc_jax.count_params(tiny(kind))
    assert counts["bank"] == 64 ** 2 * row_width  # one table of 4,096 slots shared by layers 1 and 3
    row = rows[f"kind{kind}-seed0"]
    assert row["params_active"] == counts["total"] - counts["bank"] + 2 * 4 * 8 * row_width  # layers x heads x k
    assert "top_k" not in row and "bank_tokens" not in row
  per_layer = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": "pkm", "memory.sharing": "per_layer"})
  assert sweep_report.bank_read(per_layer, 2 * 4096 * 64) == 2 * 4 * 8 * 64  # a table per layer, each read 32 rows
  small_table = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": "pkm", "memory.pkm_sub_keys": 6})
  assert sweep_report.bank_read(small_table, 36 * 64) == 36 * 64  # 64 reads of 36 slots: the whole table
  chapters = rows["kindchapters-seed0"]
  assert chapters["params_active"] == moc_jax.count_params(tiny("chapters"))["total"] - 65 * 16 * 64 + 9 * 16 * 64
  # each kind's three seeds share their FLOPs: no compute law, where one over all memory runs would mix the kinds
  assert [f for f in sweep_report.fits(list(rows.values())) if f["fit"] == "compute"] == []
  text = sweep_report.collect(sweep_dir, str(tmp_path / "out"))
  groups = {g["point"]: g for g in csv.DictReader(open(tmp_path / "out" / "seeds.csv"))}
  assert float(groups["kindpkm"]["eval_used_frac"]) == pytest.approx(0.5)
  assert float(groups["kindpkm"]["recall_without_bank"]) == pytest.approx(0.25)
  assert "| kindhml | hml | 3 |" in text
