"""What a compile report says of a step lowered and compiled for a mesh (nothing allocated: the state and batch
are ShapeDtypeStructs with their shardings) and of the state's layout; moc_jax/compile_report.py describes the
fields. Shared by the report on this host's devices and the one on a TPU slice's (moc_jax/tpu_report.py).
"""
from __future__ import annotations

import collections
import re
import time

import jax
import numpy as np

from moc_jax import sharding
from moc_jax.config import layer_plan
from moc_jax.state import build_state
from moc_jax.train.step import jit_train_step

_COLLECTIVE = re.compile(r"=\s*(.*?)\s+all-gather(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_MOSAIC_CALL = re.compile(r'^\s*%([\w.-]+) = .*custom_call_target="tpu_custom_call"')
_KERNEL_NAME = re.compile(r'op_name="[^"]*?([\w.-]+)/pallas_call"')
_XLA_FIELDS = ("argument", "output", "temp", "alias", "generated_code", "host_argument", "host_temp")


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


def mosaic_kernels(hlo_text: str) -> dict:
  """{kernel name: calls} of the Mosaic custom calls (`tpu_custom_call`, what a Pallas TPU kernel compiles to) in
  compiled HLO text; a kernel is named by its pallas_call's name, else by its instruction's."""
  found = collections.Counter()
  for line in hlo_text.splitlines():
    call = _MOSAIC_CALL.match(line)
    if call:
      name = _KERNEL_NAME.search(line)
      found[name.group(1) if name else re.sub(r"\.\d+$", "", call.group(1))] += 1
  return dict(sorted(found.items()))


def xla_memory(compiled) -> dict:
  mem = compiled.memory_analysis()
  return {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in _XLA_FIELDS}


def compile_timed(lowered):
  """(compiled, seconds)."""
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, round(time.perf_counter() - t0, 1)


def lower_train(config, mesh):
  """(state layout, the lowered train step) on `mesh`, for the state and one update's batch."""
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    batch_sharding = sharding.data_sharding(config, mesh)
    step = jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, batch_sharding)
    return layout, step.lower(layout.abstract, abstract_batch(config, batch_sharding))


def lower_eval(config, mesh, layout):
  """The lowered evaluation step (eval.ce.CEEvaluator's: CE of a forward pass) on one evaluation batch, which is
  an update's rows (`state.eval_data_config`)."""
  from moc_jax.eval.ce import CEEvaluator
  with sharding.activate(mesh, sharding.rules_of(config)):
    batch_sharding = sharding.data_sharding(config, mesh)
    evaluator = CEEvaluator(layout.graphdef, layout.shardings["params"], batch_sharding, [])
    return evaluator.step.lower(layout.abstract["params"], abstract_batch(config, batch_sharding))


def lower_decode(config, mesh, layout):
  """The lowered cached-decoding step (model/decode.py `step`, one new token per row, as `moc_jax.generate`'s loop
  runs it) for an update's rows at model.max_seq_len slots, with the cache a one-token prompt leaves (its memory
  state has the shapes of any prompt's). Every cache array is split over `batch` on its row axis."""
  from flax import nnx
  from moc_jax.model import decode
  rows, slots = config.train.batch_size * config.train.grad_accum, config.model.max_seq_len
  scanned = layer_plan(config).scanned
  with sharding.activate(mesh, sharding.rules_of(config)):
    row_spec = sharding.data_sharding(config, mesh).spec[0]

    def step(params, cache, ids):
      return decode.step(nnx.merge(layout.graphdef, params), cache, ids)

    def first(params, ids):
      model = nnx.merge(layout.graphdef, params)
      return decode.step(model, decode.init_cache(model, rows, slots), ids)[0]

    ids = jax.ShapeDtypeStruct((rows, 1), np.int32, sharding=sharding.data_sharding(config, mesh))
    cache = jax.eval_shape(first, layout.abstract["params"], ids)

    def place(path, leaf):
      axis = 1 if scanned and path and getattr(path[0], "key", None) == "layers" else 0
      spec = [None] * leaf.ndim
      if leaf.ndim:
        spec[axis] = row_spec
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                  sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

    cache = jax.tree_util.tree_map_with_path(place, cache)
    return jax.jit(step).lower(layout.abstract["params"], cache, ids)


def step_fields(compiled, hlo_text) -> dict:
  """What the report says of one compiled step (`hlo_text`: its `as_text()`)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  gather_bytes, gather_shape = largest_all_gather(hlo_text)
  return {"xla": xla_memory(compiled), "largest_all_gather": {"bytes": gather_bytes, "shape": list(gather_shape or ())},
          "flops_per_device": float(cost.get("flops", 0.0))}


def layout_fields(config, mesh, layout) -> dict:
  """What the report says of the state's layout: per-device bytes and the bank's shard."""
  out = {"config": config.name, "mesh": dict(mesh.shape), "devices": mesh.size,
         "params_bytes": sharding.shard_bytes(layout.abstract["params"]),
         "opt_state_bytes": sharding.shard_bytes(layout.abstract["opt_state"])}
  if "bank" in layout.abstract["params"]:
    bank = layout.abstract["params"]["bank"]["memory"]
    real = (bank.shape[0], layout.padding.real, *bank.shape[2:])
    out["bank"] = {"kind": config.memory.kind, "padded_shape": list(bank.shape),
                   "shard_shape": list(bank.sharding.shard_shape(bank.shape)),
                   "shard_bytes": sharding.shard_bytes([bank]), "full_copy_bytes": int(np.prod(real)) * 4,
                   "padded_chapters": layout.padding.padded - layout.padding.real}
  return out
