"""`--mode=compile`: lower and compile the train step for the configured mesh, report per-device memory.

Nothing is allocated: the state and batch are ShapeDtypeStructs with their shardings. On a CPU,
`--config.num_fake_devices=8` stands in for a pod slice, so the layout of a model too large for this
machine can be checked before it meets one. The report is one JSON line:
  params_bytes / opt_state_bytes   per device, from the shardings
  xla                              `memory_analysis()` of the compiled step (temporaries included; host_*: the
                                   arrays in host memory, e.g. train.bank_state_memory=pinned_host)
  bank                             padded shape, per-device shard shape and bytes, one full fp32 copy (the
                                   chapter bank, or the value table of memory.kind pkm / hml; padded_chapters:
                                   the rows added for sharding, chapters or slots)
  largest_all_gather               the biggest all-gather result in the optimized HLO (bytes, shape):
                                   proof that the bank is never gathered whole
  flops_per_device                 `cost_analysis()` (XLA counts a scanned body once)
"""
from __future__ import annotations

import json
import re
import time

import jax
import numpy as np

from moc_jax import sharding
from moc_jax.state import build_state
from moc_jax.train.step import jit_train_step

_COLLECTIVE = re.compile(r"=\s*(.*?)\s+all-gather(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


def abstract_batch(config, batch_sharding) -> dict:
  """The loader's global batch for one update: [batch_size * grad_accum, seq_len] int32 per field."""
  shape = (config.train.batch_size * config.train.grad_accum, config.data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=batch_sharding)
          for k in ("input_ids", "attention_mask", "labels")}


def largest_all_gather(hlo_text: str):
  """(bytes, shape) of the largest all-gather output in optimized HLO text."""
  best = (0, None)
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    for dtype, dims in _SHAPE.findall(m.group(1)):
      shape = tuple(int(d) for d in dims.split(",") if d)
      nbytes = int(np.prod(shape)) * jax.numpy.dtype(_DTYPES.get(dtype, "float32")).itemsize
      best = max(best, (nbytes, shape), key=lambda b: b[0])
  return best


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "u32": "uint32", "pred": "bool",
           "s8": "int8", "u8": "uint8", "f64": "float64", "s64": "int64", "u64": "uint64"}


def report(config) -> dict:
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    batch_sharding = sharding.data_sharding(config, mesh)
    step = jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, batch_sharding)
    t0 = time.perf_counter()
    compiled = step.lower(layout.abstract, abstract_batch(config, batch_sharding)).compile()
    seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  gather_bytes, gather_shape = largest_all_gather(compiled.as_text())
  out = {
      "config": config.name, "mesh": dict(mesh.shape), "devices": mesh.size, "compile_seconds": round(seconds, 1),
      "params_bytes": sharding.shard_bytes(layout.abstract["params"]),
      "opt_state_bytes": sharding.shard_bytes(layout.abstract["opt_state"]),
      "xla": {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias",
                                                                  "generated_code", "host_argument", "host_temp")},
      "largest_all_gather": {"bytes": gather_bytes, "shape": list(gather_shape or ())},
      "flops_per_device": float(cost.get("flops", 0.0)),
  }
  if "bank" in layout.abstract["params"]:
    bank = layout.abstract["params"]["bank"]["memory"]
    real = (bank.shape[0], layout.padding.real, *bank.shape[2:])
    out["bank"] = {"kind": config.memory.kind, "padded_shape": list(bank.shape),
                   "shard_shape": list(bank.sharding.shard_shape(bank.shape)),
                   "shard_bytes": sharding.shard_bytes([bank]), "full_copy_bytes": int(np.prod(real)) * 4,
                   "padded_chapters": layout.padding.padded - layout.padding.real}
  return out


def main(config) -> dict:
  result = report(config)
  print(json.dumps(result), flush=True)
  return result
