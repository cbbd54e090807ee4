"""Evaluating a saved run: its config rebuilt from config.json, its parameters restored onto this
machine's mesh, then CE on a split, fact recall by entity frequency, MCQ benchmarks and routing analysis,
written to eval.json (+ routing plots) and summarised as a markdown table.

A run whose routing is not causal (`sequence`, `segment`: a decision pools tokens after the position it serves)
is also scored with the same weights routed causally (`CAUSAL_ROUTING`), reported as `causally_routed` beside its
own CE: the difference is what the routing input saw of the tokens being predicted. A causal run's CE has no
such leak, so it gets no second figure. A `cluster` run reads by each document's whole path; its second figure
(`prefix_paths`) reads by each token's path from its document up to it, and its probes by their prompt's path (on a
biography corpus also by their entity's: `entity_paths`, a router's failure told from a store's); one trained with
the generic-memory control (data.cluster.generic) is also scored with every document and probe on the generic
chapters (`generic_paths`), and `--ablate_chapters=level:L` zeroes what the tree's level L owns.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import numpy as np
from flax import nnx

from moc_jax import data as data_lib
from moc_jax.data.tokenizers import model_tokenizer
from moc_jax import sharding
from moc_jax.config import memory_layers, reads_chapters, reads_cluster_paths, routing_is_causal
from moc_jax.config.schema import CHAPTER_KINDS, GENERIC_PATH
from moc_jax.errors import ConfigError, DataError
from moc_jax.eval import mcq
from moc_jax.eval import routing as ra
from moc_jax.eval.ce import CEEvaluator, split_batches
from moc_jax.eval.probes import (DOC_BUCKET_EDGES, ProbeEvaluator, entity_paths, path_alone, recall_by_bucket,
                                 select_probes, with_entity_paths, with_prompt_paths)
from moc_jax.eval.scoring import Scorer, stderr
from moc_jax.model import quantize
from moc_jax.model.build import abstract_model
from moc_jax.state import build_state, restore_params

log = logging.getLogger("moc_jax")

# The routing a non-causal run's weights are also scored with: each position's chapters chosen from the tokens of
# its document up to it (the routing mode is not a parameter, so any checkpoint can be read this way).
CAUSAL_ROUTING = "prefix"


# --- the whole evaluation ----------------------------------------------------------------------------

@dataclasses.dataclass
class EvalOptions:
  step: int | None = None                 # None: the newest checkpoint
  split: str = "validation"
  num_probes: int | None = None           # None: train.num_probes (the training log's sample); 0: every seen fact
  bucket_edges: tuple = DOC_BUCKET_EDGES
  mcq: dict = dataclasses.field(default_factory=dict)      # name -> .jsonl path
  mcq_dev: dict = dataclasses.field(default_factory=dict)  # name -> .jsonl path of k-shot examples
  shots: int = 0
  mcq_limit: int = 0                      # > 0: the first N questions of each benchmark
  analyze_routing: bool = True
  ablate_chapters: str | None = None
  quantize_bank: str | None = None        # int8 | int4: also evaluate with the bank quantized
  out: str | None = None                  # eval.json path (default workdir/eval.json); plots beside it


def _mcq_questions(o) -> dict:
  """name -> (format, path, questions) for `o.mcq`: every file read and checked before anything is compiled."""
  unknown = sorted(set(o.mcq_dev) - set(o.mcq))
  if unknown:
    raise DataError(f"--mcq_dev names {unknown} that --mcq does not; use the same name in both")
  out = {}
  for name, path in o.mcq.items():
    fmt, items = mcq.load(path)
    dev = []
    if o.shots:
      if name not in o.mcq_dev:
        raise DataError(f"--shots {o.shots} needs k-shot examples for {name!r}: add --mcq_dev={name}:PATH")
      dev_fmt, dev = mcq.load(o.mcq_dev[name])
      if dev_fmt != fmt:
        raise DataError(f"--mcq_dev {o.mcq_dev[name]} is {dev_fmt}, but {path} is {fmt}: give the "
                                 "same benchmark's dev file")
    out[name] = (fmt, path, mcq.with_shots(items[:o.mcq_limit] if o.mcq_limit else items, dev, o.shots))
  return out


def evaluate(config, workdir: str, options: EvalOptions | None = None) -> dict:
  """Evaluates `workdir`'s checkpoint under `config` (validated) on this machine's mesh; writes eval.json
  and the routing plots (process 0) and returns the report."""
  o = options or EvalOptions()
  questions = _mcq_questions(o)  # bad input fails here, before anything is restored or compiled
  ablation = ra.parse_ablation(o.ablate_chapters, config) if o.ablate_chapters else None
  if questions and reads_cluster_paths(config):
    raise ConfigError("--mcq with memory.routing=cluster: MCQ contexts are not given cluster paths yet; evaluate "
                      "without --mcq")
  if o.quantize_bank and not memory_layers(config):
    raise ConfigError(f"--quantize_bank={o.quantize_bank}: {config.name} has no memory bank to quantize")
  if o.quantize_bank and config.memory.kind != "chapters":
    raise ConfigError(f"--quantize_bank={o.quantize_bank}: quantized banks are chapter banks of memory tokens; the "
                      f"bank of memory.kind={config.memory.kind} is evaluated in float32 only — drop --quantize_bank")
  out_path = os.path.abspath(o.out or os.path.join(workdir, "eval.json"))
  tokenizer = model_tokenizer(config)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    params, step = restore_params(workdir, layout, o.step)
    graphdef = layout.graphdef
    report = {"workdir": os.path.abspath(workdir), "step": step, "config": config.name,
              "devices": mesh.size, "mesh": dict(mesh.shape), "split": o.split}
    usage = ra.Usage(config) if memory_layers(config) and (o.analyze_routing or ablation) else None
    split_eval = CEEvaluator(graphdef, layout.shardings["params"], sharding.data_sharding(config, mesh),
                             split_batches(config, o.split), routing=True)
    report.update(split_eval(params, usage.add if usage else None))
    if reads_cluster_paths(config):
      report["prefix_paths"] = _prefix_paths(config, o.split, split_eval, params, report)
    elif not routing_is_causal(config):
      report["causally_routed"] = _causally_routed(config, layout.shardings["params"], split_eval, params, report)
    probes = None
    if config.data.name == "moc_facts":
      all_probes = data_lib.load_probes(config.data)
      probes = with_prompt_paths(config, select_probes(all_probes, config.train.num_probes if o.num_probes is None
                                                       else (o.num_probes or len(all_probes)), config.seed), tokenizer)
      report["fact_recall"] = _fact_recall(ProbeEvaluator(graphdef, probes, tokenizer), params, o.bucket_edges)
    if probes and reads_cluster_paths(config) and config.data.facts.style == "biography":
      report["entity_paths"] = _entity_paths(config, graphdef, probes, all_probes, tokenizer, params, report,
                                             o.bucket_edges)
    if reads_cluster_paths(config) and config.data.cluster.generic:
      report["generic_paths"] = _generic_paths(config, o.split, split_eval, params, report, graphdef, probes,
                                               tokenizer, o.bucket_edges)
    if questions:
      scorer = Scorer(graphdef)
      report["mcq"] = {name: {"format": fmt, "path": path, "shots": o.shots,
                              **mcq.evaluate(scorer, params, qs, tokenizer, config.model.max_seq_len)}
                       for name, (fmt, path, qs) in questions.items()}
    report["files"] = {"eval_json": out_path}
    if usage is not None and o.analyze_routing:
      chapters = reads_chapters(config)
      report["routing"] = {"kind": config.memory.kind, "routing": config.memory.routing if chapters else "product keys",
                           "load_balance": config.memory.load_balance if chapters else None,
                           "num_shared": usage.num_shared, "layers": usage.stats()}
      spread = ra.balance_bias_spread(params, config.memory.num_shared)
      for layer, value in zip(report["routing"]["layers"], spread or ()):
        layer["bias_spread"] = value
      if probes and chapters and not reads_cluster_paths(config):  # stability is a router's
        report["routing"]["stability"] = ra.stability(ra.Router(graphdef), params, probes, tokenizer, config)
      stem = os.path.splitext(out_path)[0]
      report["files"].update(routing_heatmap=stem + "_routing_heatmap.png", routing_usage=stem + "_routing_usage.png")
      if jax.process_index() == 0:
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        ra.plot(usage, report["files"]["routing_heatmap"], report["files"]["routing_usage"])
    if o.quantize_bank:
      report["quantized_bank"] = _quantized(config, mesh, graphdef, params, split_eval, report, o.quantize_bank,
                                            probes, tokenizer, o.bucket_edges)
    if ablation:
      mask = ra.ablation_mask(ablation, usage)
      zeroed = ra.zero_chapters(params, mask)
      ce = split_eval(zeroed)["ce"]
      report["ablation"] = {"spec": o.ablate_chapters, "unit": usage.unit,
                            "chapters": {str(b): np.flatnonzero(m).tolist() for b, m in enumerate(mask)},
                            "selections_share": _selection_share(usage, mask), "ce": ce, "ce_delta": ce - report["ce"]}
      if probes:  # the same probes without those chapters: how much of the recall they hold
        recall = _fact_recall(ProbeEvaluator(graphdef, probes, tokenizer), zeroed, o.bucket_edges)
        report["ablation"].update(fact_recall=recall,
                                  recall_delta=recall["probe_acc"] - report["fact_recall"]["probe_acc"])
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
      json.dump(report, f, indent=1)
  return report


def _causally_routed(config, p_shard, split_eval, params, report) -> dict:
  """CE of `params` on the split's batches with `memory.routing` = CAUSAL_ROUTING, against the run's own CE."""
  causal = config.copy_and_resolve_references()
  causal.memory.routing = CAUSAL_ROUTING
  graphdef = nnx.split(abstract_model(causal), nnx.Param)[0]
  out = CEEvaluator(graphdef, p_shard, split_eval.sharding, split_eval.batches)(params)
  return {"routing": CAUSAL_ROUTING, **out, "ce_delta": out["ce"] - report["ce"]}


def _prefix_paths(config, split, split_eval, params, report) -> dict:
  """CE of `params` on the split's batches with each token's cluster path from its document up to it (causal),
  against the run's own CE, which reads by each document's whole path."""
  out = split_eval(params, batches=split_batches(config, split, paths="prefix"))
  return {**out, "ce_delta": out["ce"] - report["ce"]}


def _generic_paths(config, split, split_eval, params, report, graphdef, probes, tokenizer, edges) -> dict:
  """The generic-memory control (data.cluster.generic): CE, and recall where there are probes, with every document
  and probe reading the generic chapters instead of its path's, against the fetched figures (Pouransari et al.'s
  fetched-vs-generic gap)."""
  out = split_eval(params, batches=split_batches(config, split, paths="generic"))
  out["ce_delta"] = out["ce"] - report["ce"]
  if probes:
    generic = [{**p, "cluster_path": np.full_like(p["cluster_path"], GENERIC_PATH)} for p in probes]
    out["fact_recall"] = _fact_recall(ProbeEvaluator(graphdef, generic, tokenizer), params, edges)
    out["recall_delta"] = out["fact_recall"]["probe_acc"] - report["fact_recall"]["probe_acc"]
  return out


def _entity_paths(config, graphdef, probes, all_probes, tokenizer, params, report, edges) -> dict:
  """Recall with every probe reading its entity's path (the one its training documents took) instead of its
  prompt's, and `agreement`: at each level of the tree, the share of probes whose prompt reaches their entity's node.
  Low agreement with high recall here: the store holds facts and the tree does not send questions to them; but the
  path is fitted on the entity's whole biography, so it carries part of the answer: `path_alone` is the recall the
  path gives by itself (the value most other entities on it hold), the floor the memory's recall is read against."""
  paths = entity_paths(config, all_probes, tokenizer)
  entity = with_entity_paths(probes, paths)
  agreement = np.mean([np.asarray(p["cluster_path"]) == q["cluster_path"] for p, q in zip(probes, entity)], axis=0)
  recall = _fact_recall(ProbeEvaluator(graphdef, entity, tokenizer), params, edges)
  return {"agreement": agreement.tolist(), "fact_recall": recall, "path_alone": path_alone(probes, all_probes, paths),
          "recall_delta": recall["probe_acc"] - report["fact_recall"]["probe_acc"]}


def _fact_recall(evaluator, params, edges) -> dict:
  """The training log's recall metrics, with a standard error and the breakdown by entity frequency."""
  correct, exact = evaluator.per_probe(params)
  out = evaluator.summary(correct, exact)
  return {**out, "probe_acc_stderr": stderr(out["probe_acc"], len(correct)),
          "buckets": recall_by_bucket(evaluator.probes, correct, exact, edges)}


def _quantized(config, mesh, graphdef, params, split_eval, report, bits, probes, tokenizer, edges) -> dict:
  """CE (and fact recall) with the bank stored as int8 / int4 codes (moc_jax/model/quantize.py), against the float
  bank's figures in `report`: the same batches and probes, the codes sharded like the bank."""
  q_graphdef, q_state = nnx.split(quantize.quantize_model(nnx.merge(graphdef, params), bits))
  q_eval = CEEvaluator(q_graphdef, sharding.logical_shardings(q_state, mesh, sharding.rules_of(config)),
                       split_eval.sharding, split_eval.batches, routing=True)
  banks, _, t, d = params["bank"]["memory"][...].shape  # chapters: the user view's, not this mesh's padding
  rows = banks * config.memory.num_chapters * t
  out = {"bits": bits, **q_eval(q_state), "bank_bytes": rows * (d * int(bits[3:]) // 8 + 4),
         "float_bank_bytes": 4 * rows * d}
  out["ce_delta"] = out["ce"] - report["ce"]
  if probes:
    out["fact_recall"] = _fact_recall(ProbeEvaluator(q_graphdef, probes, tokenizer), q_state, edges)
    out["probe_acc_delta"] = out["fact_recall"]["probe_acc"] - report["fact_recall"]["probe_acc"]
  return out


def _selection_share(usage, mask):
  """Per memory layer, the share of its routed selections that went to the ablated chapters."""
  out = {}
  for i, (layer, bank) in enumerate(zip(usage.layers, usage.banks)):
    total = usage.counts[i, usage.num_shared:].sum()
    out[str(layer)] = float(usage.counts[i][mask[bank]].sum() / max(total, 1))
  return out


# --- the summary --------------------------------------------------------------------------------------

def _pm(value, err):
  return f"{value:.3f} ± {err:.3f}"


def _bucket_table(report: dict) -> list[str]:
  """Fact recall per bucket of the entity's training documents; with `--ablate_chapters`, also the same probes'
  recall with those chapters zeroed: whether the bank holds the rare entities' facts or the common ones'."""
  ablation = report.get("ablation") or {}
  zeroed = {b["docs"]: b for b in (ablation.get("fact_recall") or {}).get("buckets", [])}
  header = "| entity training docs | probes | entities | recall | exact match |"
  lines = [header + (f" recall, `{ablation['spec']}` zeroed |" if zeroed else ""),
           "|---|---:|---:|---:|---:|" + ("---:|" if zeroed else "")]
  for b in report["fact_recall"]["buckets"]:
    z = zeroed.get(b["docs"])
    lines.append(f"| {b['docs']} | {b['probes']} | {b['entities']} | {_pm(b['acc'], b['acc_stderr'])} | "
                 f"{b['exact']:.3f} |" + (f" {_pm(z['acc'], z['acc_stderr'])} |" if zeroed else ""))
  return lines


def markdown_table(report: dict) -> str:
  """The report's headline numbers as markdown tables (eval.json holds everything)."""
  devices = f"{report['devices']} device" + ("s" if report["devices"] > 1 else "")
  lines = [f"## {report['workdir']} — step {report['step']} ({report['config']}, {devices})", "",
           "| metric | value |", "|---|---:|",
           f"| {report['split']} CE (nats/token) | {report['ce']:.4f} |"]
  causal = report.get("causally_routed")
  if causal:
    lines += [f"| {report['split']} CE routed causally (`{causal['routing']}`, same weights) | {causal['ce']:.4f} |",
              f"| future-token leak in the CE above (causal − own routing) | {causal['ce_delta']:+.4f} |"]
  prefix = report.get("prefix_paths")
  if prefix:
    lines += [f"| {report['split']} CE, each token's cluster path from its prefix | {prefix['ce']:.4f} |",
              f"| future-token leak of the whole document's path (prefix − own) | {prefix['ce_delta']:+.4f} |"]
  entity = report.get("entity_paths")
  if entity:
    e = entity["fact_recall"]
    lines += [f"| prompts on their entity's path, by level of the tree | "
              f"{' / '.join(f'{a:.3f}' for a in entity['agreement'])} |",
              f"| fact recall, every probe on its entity's path | {_pm(e['probe_acc'], e['probe_acc_stderr'])} "
              f"({entity['recall_delta']:+.3f}) |",
              f"| the entity's path alone (its other entities' commonest value) | {entity['path_alone']:.3f} |"]
  generic = report.get("generic_paths")
  if generic:
    lines += [f"| {report['split']} CE, every document on the generic chapters | {generic['ce']:.4f} |",
              f"| generic − fetched CE | {generic['ce_delta']:+.4f} |"]
    if "fact_recall" in generic:
      g = generic["fact_recall"]
      lines.append(f"| fact recall on the generic chapters | {_pm(g['probe_acc'], g['probe_acc_stderr'])} "
                   f"({generic['recall_delta']:+.3f}) |")
  lines += [f"| {report['split']} perplexity | {report['ppl']:.3f} |", f"| tokens | {report['tokens']} |"]
  fr = report.get("fact_recall")
  if fr:
    lines += [f"| fact recall, likelihood choice ({fr['num_probes']} probes, chance {fr['probe_chance']:.2f}) | "
              f"{_pm(fr['probe_acc'], fr['probe_acc_stderr'])} |",
              f"| fact recall, greedy exact match | {fr['probe_exact']:.3f} |", "", *_bucket_table(report)]
  if report.get("mcq"):
    lines += ["", "| benchmark | format | items | shots | acc | acc_norm | chance |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['format']} | {r['items']} | {r['shots']} | {_pm(r['acc'], r['acc_stderr'])} | "
              f"{_pm(r['acc_norm'], r['acc_norm_stderr'])} | {r['chance']:.3f} |"
              for name, r in report["mcq"].items()]
  routing = report.get("routing")
  if routing and routing.get("kind", "chapters") not in CHAPTER_KINDS:
    lines += ["", f"memory ({routing['kind']}: value slots read by the product keys, every head and real position):",
              "", "| memory layer | slots ever read | max / mean load | usage entropy / max (nats) | effective slots |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['slots_selected']} ({r['slots_selected_frac']:.1%}) | {r['max_load']:.2f} | "
              f"{r['usage_entropy']:.2f} / {r['usage_entropy_max']:.2f} | {r['effective_slots']:.1f} |"
              for r in routing["layers"]]
  elif routing:
    stab = {s["layer"]: s for s in routing.get("stability", [])}
    unit = "columns" if routing.get("kind") == "ffn" else "chapters"  # an ffn memory's rows (eval.routing.Usage)
    lines += ["", f"routing ({routing['routing']}; shared {unit} not counted):", "",
              f"| memory layer | {unit} ever selected | max / mean load | usage entropy / max (nats) | "
              f"effective {unit} | shared-{unit[:-1]} mass | routed softmax entropy | Jaccard paraphrase | "
              "Jaccard other entity |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in routing["layers"]:
      s = stab.get(r["layer"], {})
      jac = " | ".join(f"{s.get(k, float('nan')):.3f}" for k in ("paraphrase_jaccard", "other_entity_jaccard"))
      lines.append(f"| {r['layer']} | {r[f'{unit}_selected']} ({r[f'{unit}_selected_frac']:.0%}) | "
                   f"{r['max_load']:.2f} | {r['usage_entropy']:.2f} / {r['usage_entropy_max']:.2f} | "
                   f"{r[f'effective_{unit}']:.1f} | {r.get('shared_mass', float('nan')):.3f} | "
                   f"{r.get('routed_entropy', float('nan')):.2f} | {jac} |")
    if any("pool_share" in r for r in routing["layers"]):
      lines += ["", "attention pooling, share of a row's positions a decision weighs (1 = the plain mean): "
                + ", ".join(f"layer {r['layer']} {r['pool_share']:.3f}" for r in routing["layers"])]
  q = report.get("quantized_bank")
  if q:
    lines += ["", f"{q['bits']} bank ({q['bank_bytes'] / 1e6:.2f} MB, float32 {q['float_bank_bytes'] / 1e6:.2f} MB): "
              f"{report['split']} CE {report['ce']:.6f} -> {q['ce']:.6f} ({q['ce_delta']:+.3g})"
              + (f"; fact recall {report['fact_recall']['probe_acc']:.3f} -> {q['fact_recall']['probe_acc']:.3f}"
                 if "fact_recall" in q else "")]
  ab = report.get("ablation")
  if ab:
    n = max(len(v) for v in ab["chapters"].values())
    lines += ["", f"ablation `{ab['spec']}` ({n} {ab.get('unit', 'chapters')} zeroed): CE {report['ce']:.4f} -> {ab['ce']:.4f} "
              f"({ab['ce_delta']:+.3g})"
              + (f"; fact recall {report['fact_recall']['probe_acc']:.3f} -> {ab['fact_recall']['probe_acc']:.3f}"
                 if "fact_recall" in ab else "")]
  lines += [""] + [f"{k}: {v}" for k, v in report["files"].items()]
  return "\n".join(lines)
