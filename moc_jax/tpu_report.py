"""`python -m moc_jax.compile_report --topology=NAME`: the train, evaluation and decoding steps compiled by the TPU
compiler for a slice's devices on a host without one (moc_jax/tpu_topology.py), its verdict on whether they fit a chip's
HBM, and, when the train step does not, the largest micro-batch that does.

The search keeps the update (batch_size x grad_accum rows) and bisects over the rows each device takes per
micro-batch, among those that divide a device's share of the update: fewer rows need fewer temporaries, so a
count that fits bounds the answer from below and one that does not from above. Each probe is one compile.
"""
from __future__ import annotations

import json
import time

import jax

from moc_jax import compile_fields, sharding, tpu_topology
from moc_jax.config import validate
from moc_jax.errors import ConfigError, UsageError


def compile_step(lowered, hbm) -> dict:
  """compile_seconds and fits; then the step's fields, its Mosaic kernels and hbm_margin_bytes, or (the compiler
  refused it for want of HBM) the HBM it asked for. The margin is `hbm` less what memory_analysis counts on a
  device (arguments, outputs not aliased to them, temporaries): the compiler has accepted steps whose count
  exceeds the HBM it names by up to 2.5 GiB, so a negative margin is reported, not hidden."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    oom = tpu_topology.hbm_oom(e)
    if oom is None:
      raise
    seconds = round(time.perf_counter() - t0, 1)
    return {"compile_seconds": seconds, "fits": False, "hbm_required_bytes": oom["required_bytes"]}
  seconds, text = round(time.perf_counter() - t0, 1), compiled.as_text()
  fields = compile_fields.step_fields(compiled, text)
  xla = fields["xla"]
  margin = hbm - (xla["argument"] + xla["output"] - xla["alias"] + xla["temp"])
  return {"compile_seconds": seconds, "fits": True, **fields, "hbm_margin_bytes": margin,
          "kernels": compile_fields.mosaic_kernels(text)}


def with_micro_batch(config, rows_per_device, shards):
  """`config` with `rows_per_device` rows per device per micro-batch and the same update size."""
  update = config.train.batch_size * config.train.grad_accum
  out = config.copy_and_resolve_references()
  out.train.batch_size = rows_per_device * shards
  out.train.grad_accum = update // out.train.batch_size
  return out


def largest_fitting(config, shards, compile_train) -> dict:
  """{answer, searched}: the largest micro-batch below `config`'s (which does not fit) whose train step fits,
  {rows_per_device, batch_size, grad_accum, compile_seconds, xla, hbm_margin_bytes, kernels}, or None if not even
  one row per device does; and every count compiled, {rows per device: fits}. `shards`: the devices a micro-batch
  is split over; `compile_train(config)`: `compile_step` of that config's train step."""
  share, rows = config.train.batch_size * config.train.grad_accum // shards, config.train.batch_size // shards
  candidates = []
  for r in range(1, rows):
    if share % r == 0:
      try:
        validate(with_micro_batch(config, r, shards))
      except ConfigError:
        continue
      candidates.append(r)
  searched, best, lo, hi = {}, None, -1, len(candidates)  # candidates[lo] fits, candidates[hi] does not
  while hi - lo > 1:
    mid = (lo + hi) // 2
    trial = with_micro_batch(config, candidates[mid], shards)
    step = compile_train(trial)
    searched[candidates[mid]] = step["fits"]
    if step["fits"]:
      lo, best = mid, {"rows_per_device": candidates[mid], "batch_size": trial.train.batch_size,
                       "grad_accum": trial.train.grad_accum, "compile_seconds": step["compile_seconds"],
                       **{k: step[k] for k in ("xla", "hbm_margin_bytes", "kernels")}}
    else:
      hi = mid
  return {"answer": best, "searched": searched}


def report(config, devices, topology) -> dict:
  """The report of `config`'s train, evaluation and decoding steps on `devices`, the compile-only devices of
  `topology`."""
  mesh = sharding.make_mesh(config, devices)
  layout, lowered = compile_fields.lower_train(config, mesh)
  shards, hbm = sharding.shards(config, "batch", dict(mesh.shape)), tpu_topology.hbm_bytes(devices[0])
  out = {"topology": topology, "chip": devices[0].device_kind, "hbm_bytes": hbm,
         "libtpu": tpu_topology.libtpu_version(), **compile_fields.layout_fields(config, mesh, layout),
         "seq_len": config.data.seq_len, "rows_per_device": config.train.batch_size // shards,
         "grad_accum": config.train.grad_accum, **compile_step(lowered, hbm)}
  rows = config.train.batch_size * config.train.grad_accum // shards
  out["eval"] = {"rows_per_device": rows, **compile_step(compile_fields.lower_eval(config, mesh, layout), hbm)}
  out["decode"] = {"rows_per_device": rows, "slots": config.model.max_seq_len,
                   **compile_step(compile_fields.lower_decode(config, mesh, layout), hbm)}
  if not out["fits"]:
    train = lambda c: compile_step(compile_fields.lower_train(c, sharding.make_mesh(c, devices))[1], hbm)
    search = largest_fitting(config, shards, train)
    out["largest_fitting"], out["searched"] = search["answer"], search["searched"]
  return out


def _gib(n) -> str:
  return f"{n / tpu_topology.GIB:.2f} GiB"


def _rows(n) -> str:
  return f"{n} row{'s' if n != 1 else ''}"


def _needs(step) -> str:
  if not step["fits"]:
    return f"{_gib(step['hbm_required_bytes'])} of HBM (arguments, outputs and temporaries)"
  margin = step["hbm_margin_bytes"]
  over = "" if margin >= 0 else f" (the compiler accepted it, but that is {_gib(-margin)} more than the HBM)"
  return f"{_gib(step['xla']['temp'])} of temporaries and {_gib(step['xla']['argument'])} of arguments{over}"


def verdict(r) -> str:
  """One line: whether the train step fits and, if not, the largest micro-batch that does; then the evaluation and
  decoding steps."""
  where = f"on {r['topology']} ({r['devices']} x {r['chip']}, {_gib(r['hbm_bytes'])} of HBM per device)"
  train = f"the train step at {_rows(r['rows_per_device'])} of {r['seq_len']} per device per micro-batch"
  if r["fits"]:
    line = f"fits {where}: {train} needs {_needs(r)}"
  else:
    line = f"does not fit {where}: {train} needs {_needs(r)}; "
    best = r["largest_fitting"]
    line += ("not even 1 row per device fits" if best is None else
             f"the largest micro-batch that fits is {_rows(best['rows_per_device'])} per device "
             f"(--config.train.batch_size={best['batch_size']} --config.train.grad_accum={best['grad_accum']}: "
             f"{_needs({'fits': True, **best})})")
  e, d = r["eval"], r["decode"]
  return line + (f"; the evaluation step at {_rows(e['rows_per_device'])} per device "
                 f"{'fits' if e['fits'] else 'does not fit'}: it needs {_needs(e)}; the decoding step (one token "
                 f"of {_rows(d['rows_per_device'])} per device, {d['slots']} cache slots) "
                 f"{'fits' if d['fits'] else 'does not fit'}: it needs {_needs(d)}")


def list_chips() -> str:
  """The chips the installed libtpu knows, one line each, with the HBM a program may use on one device."""
  lines = [f"libtpu {tpu_topology.libtpu_version()}: --topology=CHIP:SHAPE, e.g. v5e:4x4 or v5p:4x4x4"]
  for chip, device in tpu_topology.chips():
    lines.append(f"{chip:6} {device.device_kind:12} {_gib(tpu_topology.hbm_bytes(device))} of HBM per device")
  return "\n".join(lines)


def main(config, topology):
  """The command's work once its flags are parsed: refuses without libtpu, lays `config` out for the topology's
  devices (num_fake_devices carries their count, which validation and the bank's padding read; no CPU device is
  made for it) and prints the report and the verdict."""
  if not tpu_topology.installed():
    raise UsageError(f"--topology needs libtpu, which is not installed: {tpu_topology.INSTALL}")
  if config is not None and config.num_fake_devices:
    raise UsageError("--topology compiles for the slice's devices: drop --config.num_fake_devices")
  jax.config.update("jax_platforms", "cpu")  # this host's own devices take no part
  if topology == "list":
    print(list_chips())
    return None
  devices = tpu_topology.devices(topology)
  config.num_fake_devices = len(devices)
  validate(config)
  result = report(config, devices, topology)
  print(json.dumps(result), flush=True)
  print(verdict(result), flush=True)
  return result
