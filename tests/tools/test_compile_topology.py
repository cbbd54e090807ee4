"""`python -m moc_jax.compile_report --topology=NAME`: the train, evaluation and decoding steps compiled by the TPU
compiler for a slice's compile-only devices on this CPU host (needs libtpu, the `tpu` extra; those tests skip
without it), and, on their own, the micro-batch search, the reading of the compiler's output, and the refusal without libtpu."""
import json
import os
import subprocess
import sys

import pytest

import moc_jax
from moc_jax import compile_fields, tpu_report, tpu_topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tiny routed per token, cut to what the checks need so that each compile is quick; memory.attention_impl=auto
# (the default) takes the Pallas kernels when the step is traced for a TPU's devices
TOKEN = ["--config=configs/moc.py:tiny", "--config.memory.routing=token", "--config.model.num_layers=2",
         "--config.memory.layer_indices=(1,)", "--config.model.remat=none", "--config.data.seq_len=128"]


@pytest.fixture
def libtpu():
  pytest.importorskip("libtpu", reason="libtpu (the `tpu` extra: pip install 'moc_jax[tpu]') compiles for TPU slices")


def command(*args, timeout=900):
  """`python -m moc_jax.compile_report ARGS` from the repository root -> (exit code, stdout lines, stderr)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
  proc = subprocess.run([sys.executable, "-m", "moc_jax.compile_report", *args], check=False, capture_output=True,
                        text=True, timeout=timeout, env=env, cwd=ROOT)
  return proc.returncode, proc.stdout.splitlines(), proc.stderr


@pytest.mark.slow  # compiles for the TPU three times; the search and the error reading: the unit tests below
def test_a_micro_batch_too_large_is_one_line_naming_the_largest_that_fits(libtpu):
  """4,006 rows per device (2 x 2003) need about 3x a v5e's HBM: the compiler refuses the train step and the
  evaluation step; the search compiles 2 rows (fits, its train step holds both Mosaic kernels) and 2003 (does not)."""
  code, out, err = command(*TOKEN, "--topology=v5e:2x2", "--config.train.batch_size=16024")
  assert code == 0, err[-3000:]
  report, verdict = json.loads(out[0]), out[1]
  assert len(out) == 2 and "Traceback" not in err
  assert report["topology"] == "v5e:2x2" and report["chip"] == "TPU v5 lite" and report["devices"] == 4
  assert report["hbm_bytes"] == round(15.75 * 2**30) and report["libtpu"] == tpu_topology.libtpu_version()
  assert report["rows_per_device"] == 4006 and not report["fits"] and "xla" not in report
  assert report["hbm_required_bytes"] > 2 * report["hbm_bytes"]
  assert not report["eval"]["fits"] and report["eval"]["rows_per_device"] == 4006
  best = report["largest_fitting"]
  assert report["searched"] == {"2": True, "2003": False}
  assert (best["rows_per_device"], best["batch_size"], best["grad_accum"]) == (2, 8, 2003)
  assert best["kernels"] == {"routed_chapter_attention_bwd": 1, "routed_chapter_attention_fwd": 1}
  assert 0 < best["xla"]["temp"] < report["hbm_bytes"] and best["hbm_margin_bytes"] > 0
  assert verdict.startswith("does not fit on v5e:2x2 (4 x TPU v5 lite, 15.75 GiB of HBM per device): the train step "
                            "at 4006 rows of 128 per device per micro-batch needs ")
  assert "the largest micro-batch that fits is 2 rows per device (--config.train.batch_size=8 " \
         "--config.train.grad_accum=2003: " in verdict
  assert "the evaluation step at 4006 rows per device does not fit" in verdict
  decode = report["decode"]  # one token a row against a 256-slot cache: small beside a forward over every position
  assert (decode["rows_per_device"], decode["slots"]) == (4006, 256) and decode["fits"]
  assert decode["kernels"] == {"routed_chapter_attention_fwd": 1} and decode["xla"]["temp"] < report["hbm_bytes"]
  assert verdict.endswith(f"the decoding step (one token of 4006 rows per device, 256 cache slots) fits: it needs "
                          f"{decode['xla']['temp'] / 2**30:.2f} GiB of temporaries and "
                          f"{decode['xla']['argument'] / 2**30:.2f} GiB of arguments")


@pytest.mark.slow
def test_a_step_that_fits_reports_its_memory_and_kernels(libtpu):
  """The bank split over memory=2: the train step runs the forward kernel twice (the recomputed forward too) and
  the fused backward once; the evaluation step runs the forward."""
  code, out, err = command(*TOKEN, "--topology=v5e:2x2", "--config.mesh.data=2", "--config.mesh.memory=2")
  assert code == 0, err[-3000:]
  report, verdict = json.loads(out[0]), out[1]
  assert report["fits"] and report["rows_per_device"] == 4 and report["mesh"]["memory"] == 2
  assert report["bank"]["shard_shape"] == [1, 33, 16, 64]
  assert report["kernels"]["routed_chapter_attention_bwd"] == 1 and report["kernels"]["routed_chapter_attention_fwd"]
  assert 0 < report["xla"]["temp"] < report["hbm_bytes"] and report["flops_per_device"] > 0
  assert report["hbm_margin_bytes"] > 0
  assert report["eval"]["fits"] and report["eval"]["kernels"] == {"routed_chapter_attention_fwd": 1}
  assert report["decode"]["fits"] and report["decode"]["kernels"] == {"routed_chapter_attention_fwd": 1}
  assert "largest_fitting" not in report
  assert verdict.startswith("fits on v5e:2x2 (4 x TPU v5 lite, 15.75 GiB of HBM per device): the train step at 4 "
                            "rows of 128 per device per micro-batch needs ")


def test_an_unknown_topology_is_one_line_naming_the_chips(libtpu):
  code, out, err = command("--config=configs/moc.py:tiny", "--topology=v9z:2x2")
  assert code == 2 and out == []
  (line,) = err.strip().splitlines()
  assert line.startswith("error: --topology=v9z:2x2: ") and "v5e, v5p" in line


def test_a_mesh_that_does_not_lay_out_on_the_torus_is_one_line(libtpu):
  """A v5p slice is a 4x4x4 torus: a mesh axis of 8 takes no whole set of its axes."""
  code, out, err = command("--config=configs/moc.py:tiny", "--topology=v5p:4x4x4", "--config.mesh.data=8",
                           "--config.mesh.memory=8", "--config.train.batch_size=64")
  assert code == 2 and out == []
  (line,) = err.strip().splitlines()
  assert line.startswith("error: config.mesh: data=8 x memory=8 x fsdp=1 x tensor=1 does not lay out on the torus "
                         "of the 64 TPU v5 devices (") and "remaining assignable mesh [4, 4, 4]" in line


def test_without_libtpu_the_flag_is_refused_in_one_line():
  """As if libtpu were not installed (the command's own check, patched): exit 2 and how to install it."""
  patched = ("import runpy, sys; from moc_jax import tpu_topology; tpu_topology.installed = lambda: False; "
             "sys.argv = ['compile_report', '--config=configs/moc.py:tiny', '--topology=v5e:2x2']; "
             "runpy.run_module('moc_jax.compile_report', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", patched], check=False, capture_output=True, text=True, timeout=300,
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip() == f"error: --topology needs libtpu, which is not installed: {tpu_topology.INSTALL}"


def test_the_search_bisects_over_the_rows_that_divide_a_devices_share():
  """A 36-row share on 4 devices: counts 1, 2, 3, 4, 6, 9, 12, 18 below 36; 6 or fewer fit."""
  config = moc_jax.load_config("configs/moc.py:tiny", {"train.batch_size": 144, "train.grad_accum": 1})
  compiled = []

  def compile_train(c):
    rows = c.train.batch_size // 4
    compiled.append(rows)
    assert c.train.batch_size * c.train.grad_accum == 144
    if rows > 6:
      return {"fits": False}
    return {"fits": True, "compile_seconds": 1.0, "xla": {"temp": rows}, "hbm_margin_bytes": 10 - rows, "kernels": {}}

  search = tpu_report.largest_fitting(config, 4, compile_train)
  assert search["answer"] == {"rows_per_device": 6, "batch_size": 24, "grad_accum": 6, "compile_seconds": 1.0,
                              "xla": {"temp": 6}, "hbm_margin_bytes": 4, "kernels": {}}
  assert compiled == [4, 9, 6] and search["searched"] == {4: True, 9: False, 6: True}
  assert tpu_report.largest_fitting(config, 4, lambda c: {"fits": False})["answer"] is None


def test_the_compilers_out_of_memory_error_and_kernels_are_read():
  error = RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
                       "required for HLO temporaries (40.00G) exceeds available HBM (15.75G). HLO module: jit_f.")
  assert tpu_topology.hbm_oom(error) == {"required_bytes": 40 * 2**30, "hbm_bytes": round(15.75 * 2**30)}
  assert tpu_topology.hbm_oom(RuntimeError("INTERNAL: something else")) is None
  kernel = ('  %routed_chapter_attention_fwd.2 = (f32[4,16]) custom-call(%a), custom_call_target="tpu_custom_call", '
            'metadata={op_name="jit(train_step)/shard_map/jit(_call)/routed_chapter_attention_fwd/pallas_call"}')
  unnamed = '  %custom-call.7 = f32[4] custom-call(%b), custom_call_target="tpu_custom_call", metadata={op_name="x/y"}'
  hlo = f"{kernel}\n{unnamed}\n  %fusion.3 = f32[4] fusion(%c), kind=kLoop, calls=%fused_computation.3"
  assert compile_fields.mosaic_kernels(hlo) == {"custom-call": 1, "routed_chapter_attention_fwd": 1}
