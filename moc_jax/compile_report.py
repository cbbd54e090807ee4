"""Lower and compile the train step for the configured mesh and report per-device memory; nothing is allocated.

The state and batch are ShapeDtypeStructs with their shardings. Two ways to stand in for a pod slice on a host
without one:

* `python -m moc_jax.main --mode=compile --config.num_fake_devices=8` (or this module without --topology): n CPU
  devices, so the layout of a model too large for this machine can be checked before it meets one;
* `python -m moc_jax.compile_report --config=configs/moc.py:262k --topology=v5e:4x4`: the compile-only devices of
  a TPU slice (the `tpu` extra installs libtpu; `--topology=list` names the chips it knows). The TPU compiler
  itself compiles the train, evaluation and decoding steps (XLA, and Mosaic for the Pallas kernels), and refuses a
  step that does not fit a chip's HBM: that refusal is the answer, and the largest micro-batch that fits is
  searched for (moc_jax/tpu_report.py).

The report is one JSON line:
  params_bytes / opt_state_bytes   per device, from the shardings
  xla                              `memory_analysis()` of the compiled step (temporaries included; host_*: the
                                   arrays in host memory, e.g. train.bank_state_memory=pinned_host)
  bank                             padded shape, per-device shard shape and bytes, one full fp32 copy (the
                                   chapter bank, or the value table of memory.kind pkm / hml; padded_chapters:
                                   the rows added for sharding, chapters or slots)
  largest_all_gather               the biggest all-gather result in the optimized HLO (bytes, shape):
                                   proof that the bank is never gathered whole
  flops_per_device                 `cost_analysis()` (XLA counts a scanned body once)
With --topology also:
  topology, chip, hbm_bytes        the slice, its devices' kind, the HBM the compiler lets a program use on one;
                                   libtpu: the version that compiled
  rows_per_device, seq_len         sequences per device per micro-batch and their length; grad_accum
  fits                             whether the compiler accepted the train step; if not, hbm_required_bytes
                                   (its error's figure: arguments, outputs and temporaries) replaces xla,
                                   largest_all_gather, flops_per_device and kernels
  kernels                          Mosaic kernels (Pallas on TPU) in the compiled step: {name: calls}
  hbm_margin_bytes                 hbm_bytes less memory_analysis' count (arguments + outputs - aliases +
                                   temporaries); the compiler has accepted steps for which it is negative
  eval                             the evaluation step (a forward over an update's rows, as the training loop
                                   evaluates): rows_per_device, compile_seconds, fits, and the fields above
  decode                           the cached-decoding step (`moc_jax.generate`'s: one new token for each of an
                                   update's rows, model.max_seq_len cache slots): rows_per_device, slots,
                                   compile_seconds, fits, and the fields above
  largest_fitting                  when the train step does not fit: the largest micro-batch that does (rows per
                                   device, batch_size, grad_accum at the same update size, its xla, margin
                                   and kernels), or null; searched: {rows per device: fits} of every count compiled
and a last line, the verdict.
"""
from __future__ import annotations

import json

from absl import flags

from moc_jax import cli, compile_fields, sharding


def report(config) -> dict:
  """The train step compiled for `config`'s mesh over this host's devices (fake CPU ones for a slice)."""
  mesh = sharding.make_mesh(config)
  layout, lowered = compile_fields.lower_train(config, mesh)
  compiled, seconds = compile_fields.compile_timed(lowered)
  return {**compile_fields.layout_fields(config, mesh, layout), "compile_seconds": seconds,
          **compile_fields.step_fields(compiled, compiled.as_text())}


def main(config) -> dict:
  result = report(config)
  print(json.dumps(result), flush=True)
  return result


def define_flags():
  """This command's flags (defined only when it runs: `moc_jax.main --mode=compile` imports this module)."""
  cli.define_config_file_flag("Config file and argument, e.g. configs/moc.py:262k.")
  flags.DEFINE_string("topology", None, "Compile for this TPU slice's devices instead of this host's, e.g. v5e:4x4 "
                      "or v5p:4x4x4 (needs the `tpu` extra); `list` names the chips the installed libtpu knows.")


def _command(argv):
  from moc_jax.config import validate
  from moc_jax.errors import UsageError
  cli.begin(argv, datasets=False)
  config, topology = flags.FLAGS.config, flags.FLAGS.topology
  if config is None and topology != "list":
    raise UsageError("--config=PATH.py:ARG is required")
  if topology is None:
    cli.use_fake_devices(config.num_fake_devices)
    validate(config)
    main(config)
    return
  from moc_jax import tpu_report
  tpu_report.main(config, topology)


if __name__ == "__main__":
  define_flags()
  cli.run(_command)
