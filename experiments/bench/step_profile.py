"""Where the train step's time goes: XLA's own per-op timing of the production step, op by op.

The step is the benchmarks' `common.Trainer` (the loop's jitted step on one device, a fixed synthetic batch). After
`--warmup` steps, `--steps` steps run under `jax.profiler`; the trace's executor events are summed per HLO op of the
compiled step and divided by the steps. Each op is matched to its line of the optimised HLO (`compiled.as_text()`):
a dot, or a fusion whose computation holds a dot, is a matmul and gets its FLOPs per step (2 x output elements x
contracted size, times its calls per step: a loop body's op runs once per trip) and the time they would take at the
device's matmul peak, measured in this process as `train_mfu` does. Every other op is memory traffic (copies, transposes, elementwise fusions, reductions) and has no FLOPs to be measured by.

Read the table for the gap between `ms` and `ms at peak` (a matmul run badly) and for big non-matmul ops (work
a different formulation or layout avoids). Times are a traced run's: a few percent above an untraced step.

`python -m experiments.bench.step_profile [--config=configs/moc.py:small] [--set model.compute_dtype=float32]
 [--steps 3] [--top 25] [--markdown]`
"""
from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import jax
from absl import flags

from experiments.bench import common
from moc_jax import cli

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:small", None)
flags.DEFINE_integer("steps", 3, "profiled steps", flag_values=_FLAGS)
flags.DEFINE_integer("warmup", 2, "untimed steps after compilation", flag_values=_FLAGS)
flags.DEFINE_integer("top", 25, "ops listed, by time", flag_values=_FLAGS)
flags.DEFINE_bool("markdown", False, "also print the categories and the top ops as markdown tables", flag_values=_FLAGS)

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+?)(?:\{[^}]*\})? (\w[\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_SHAPE = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_RUNTIME = ("ThunkExecutor", "SlinkyThreadPool")  # executor bookkeeping, not ops


def parse_hlo(text: str) -> tuple[dict, dict]:
  """Optimised HLO text -> ({instruction: (shape, opcode, rest of line, computation)}, {computation: [instruction]})."""
  ops, computations, current = {}, collections.defaultdict(list), None
  for line in text.splitlines():
    if (m := _COMPUTATION.match(line)) and " = " not in line:
      current = m.group(1)
      continue
    if (m := _INSTRUCTION.match(line)):
      name, shape, opcode, rest = m.groups()
      ops[name] = (shape, opcode, rest, current)
      computations[current].append(name)
  return ops, computations


def dims(shape: str) -> list[int]:
  m = _SHAPE.match(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def dot_flops(name: str, ops: dict, computations: dict, depth: int = 0) -> float:
  """FLOPs of the dots `name` runs: itself if a dot, else the dots of the computations it calls."""
  shape, opcode, rest, _ = ops[name]
  if opcode == "dot":
    lhs = ops.get(re.match(r"\s*%?([\w.\-]+)", rest).group(1))
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    if lhs is None or contract is None:
      return 0.0
    size = 1
    for d in contract.group(1).split(","):
      size *= dims(lhs[0])[int(d)] if d else 1
    out = 1
    for d in dims(shape):
      out *= d
    return 2.0 * out * size
  total = 0.0
  if depth < 3:
    for callee in re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", rest):
      total += sum(dot_flops(i, ops, computations, depth + 1) for i in computations.get(callee, ()))
  return total


def op_times(trace_dir: str, steps: int) -> tuple[collections.Counter, collections.Counter]:
  """(seconds, calls) per step of each HLO op in the trace under `trace_dir`, summed over the executor threads
  (an op in a loop body runs once per trip)."""
  path = next(Path(trace_dir).rglob("*.xplane.pb"))
  data = jax.profiler.ProfileData.from_file(str(path))
  seconds, calls = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if line.name.startswith("tf_XLA"):
        events = [(e.start_ns, e.end_ns, e.name) for e in line.events if not e.name.startswith(_RUNTIME)]
        for name, ns in self_times(events).items():
          seconds[name] += ns * 1e-9 / steps
        for _, _, name in events:
          calls[name] += 1 / steps
  return seconds, calls


def self_times(events) -> collections.Counter:
  """(start, end, name) events of one thread -> each name's own time: a while loop's or a call's event encloses
  the events of the ops it runs, whose time counts for them, not for it."""
  own, stack = collections.Counter(), []  # stack: [name, start, end, enclosed time]
  for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
    while stack and stack[-1][2] <= start:
      done = stack.pop()
      own[done[0]] += done[2] - done[1] - done[3]
    if stack:
      stack[-1][3] += end - start
    stack.append([name, start, end, 0])
  for name, start, end, enclosed in stack:
    own[name] += end - start - enclosed
  return own


def category(opcode: str, flops: float, name: str) -> str:
  if flops:
    return "matmul"
  if "reduce" in name or opcode == "reduce":
    return "reduction"
  if re.search(r"copy|transpose|broadcast|dynamic|slice|concatenate|pad|gather|scatter", name + opcode):
    return "copy / layout"
  return "elementwise"


def run(config="configs/moc.py:small", batch_size=None, overrides=None, steps=3, warmup=2, top=25) -> dict:
  cfg, _ = common.load(config, batch_size, overrides)
  peak, _ = common.device_peak(cfg.model.compute_dtype)
  trainer = common.trainer(cfg)
  untraced = common.summary(trainer.run(steps, warmup))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    traced = common.summary(trainer.run(steps))
    jax.profiler.stop_trace()
    seconds, calls = op_times(trace_dir, steps)
  ops, computations = parse_hlo(trainer._step.as_text())
  rows, by_category = [], collections.Counter()
  for name, s in seconds.most_common():
    shape, opcode, rest, _ = ops.get(name, ("?", "?", "", None))
    f = dot_flops(name, ops, computations) * calls[name] if name in ops else 0.0
    cat = category(opcode, f, name)
    by_category[cat] += s
    source = re.search(r'op_name="([^"]*)"', rest)
    rows.append({"op": name, "category": cat, "shape": shape, "ms": 1e3 * s, "calls": calls[name],
                 "gflop": f / 1e9, "gflops_per_s": f / s / 1e9 if f and s else None,
                 "ms_at_peak": 1e3 * f / peak if peak and f else None,
                 "source": source.group(1).split("/")[-1] if source else ""})
  matmul_flops = sum(r["gflop"] for r in rows) * 1e9
  total = sum(by_category.values())
  return {"name": "step_profile", "config": config, "overrides": overrides or {},
          "batch": [cfg.train.batch_size * cfg.train.grad_accum, cfg.data.seq_len],
          "compute_dtype": cfg.model.compute_dtype, "compile_s": trainer.compile_s, "step": untraced,
          "traced_step": traced, "op_seconds_per_step": total, "peak_flops_per_s": peak,
          "model_flops_per_step": trainer.flops_per_step, "matmul_flops_per_step": matmul_flops,
          "matmul_s_at_peak": matmul_flops / peak if peak else None,
          "categories": {k: {"s": v, "share": v / total} for k, v in by_category.most_common()},
          "top": rows[:top], "goal": "(none: a profile)", "pass": None}


def markdown(result: dict) -> str:
  lines = ["| category | ms / step | share |", "|---|---|---|"]
  lines += [f"| {k} | {1e3 * v['s']:.1f} | {100 * v['share']:.1f}% |" for k, v in result["categories"].items()]
  lines += ["", "| op | category | shape | ms / step | GFLOP | GFLOP/s | ms at peak | from |", "|---|---|---|---|---|---|---|---|"]
  for r in result["top"]:
    at_peak = f"{r['ms_at_peak']:.1f}" if r["ms_at_peak"] else ""
    rate = f"{r['gflops_per_s']:.0f}" if r["gflops_per_s"] else ""
    lines.append(f"| {r['op']} | {r['category']} | `{r['shape']}` | {r['ms']:.1f} | {r['gflop']:.2f} | {rate} | {at_peak} | "
                 f"{r['source'][:40]} |")
  return "\n".join(lines)


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  result = run(args.config, args.batch_size, common.parse_overrides(args.set), args.steps, args.warmup, args.top)
  if args.markdown:
    print(markdown(result))
  return common.emit(result)


if __name__ == "__main__":
  main()
