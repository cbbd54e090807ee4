"""The benchmarks run end to end on tiny sizes and print one finite JSON line; MFU peaks and their cache.

Smoke tests only: timings here are meaningless, docs/performance.md has the real runs.
"""
import json
import math
import re

import jax
import pytest

from experiments.bench import (
  bank_scaling,
  common,
  cpu_peak,
  input_pipeline,
  moc_vs_vanilla,
  routed_attention,
  step_profile,
  step_ratio,
  train_mfu,
  xla_vs_analytic,
)
import moc_jax
from moc_jax import cli, flops
from moc_jax.train import peaks

TINY = "configs/moc.py:tiny"
SEQ32 = ["--set", "data.seq_len=32", "--set", "model.max_seq_len=32"]
# Two layers (one memory layer): compiling, not running, is what these tests spend their time on.
SHORT = [*SEQ32, "--set", "model.num_layers=2", "--set", "memory.layer_indices=(1,)"]


def _finite(tree, path="result"):
  if isinstance(tree, dict):
    for k, v in tree.items():
      _finite(v, f"{path}.{k}")
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      _finite(v, f"{path}[{i}]")
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    assert math.isfinite(tree), path


def _run(module, argv, capsys):
  result = module.main(argv)
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and json.loads(lines[0]) == json.loads(json.dumps(result))  # tuples print as lists
  _finite(result)
  for key in ("name", "config", "goal", "pass", "environment"):
    assert key in result
  assert {"device_kind", "jax", "cores"} <= set(result["environment"])
  return result


@pytest.mark.slow  # the default suite keeps xla_vs_analytic as the harness's smoke test
def test_train_mfu(capsys):
  r = _run(train_mfu, [f"--config={TINY}", "--batch_size=2", "--steps=1", "--warmup=0", "--profile_reps=1",
                       "--peak_sizes=128", *SHORT], capsys)
  assert 0 < r["mfu"] < r["hfu"]
  assert r["peak_source"].startswith("peaks.measure")
  assert set(r["profile"]["components"]) == {"self_attention", "mlp", "memory", "head"}
  assert r["profile"]["optimizer_s"] > 0


@pytest.mark.slow
def test_moc_vs_vanilla(capsys):
  # SHORT fixes the depth, so the baseline here is the 2-layer vanilla model, not the iso-FLOP one.
  r = _run(moc_vs_vanilla, [f"--config={TINY}", "--vanilla=configs/vanilla.py:tiny", "--batch_size=2",
                            "--rounds=1", "--steps_per_round=1", *SHORT], capsys)
  assert r["layers"] == {"moc": 2, "vanilla": 2} and r["flop_ratio"] > 1
  assert r["time_over_flops"] == pytest.approx(r["time_ratio"] / r["flop_ratio"])


def test_iso_vanilla_baseline():
  """The iso-FLOP vanilla of tiny is the depth whose training FLOPs per micro-step are nearest MoC tiny's, found
  here by trying every depth up to 16."""
  assert moc_vs_vanilla.iso_vanilla("configs/moc.py:small") == "configs/vanilla.py:iso=small"
  config, note = common.load(moc_vs_vanilla.iso_vanilla(TINY))
  goal = flops.estimate(moc_jax.load_config(TINY))["train"]["micro_step"]

  def miss(layers):
    vanilla = moc_jax.load_config("configs/vanilla.py:tiny", {"model.num_layers": layers})
    return abs(flops.estimate(vanilla)["train"]["micro_step"] - goal)

  layers = min(range(1, 17), key=miss)
  assert config.model.num_layers == layers and note.startswith(f"configs/vanilla.py:iso=tiny: {layers} layers")


@pytest.mark.slow
def test_bank_scaling(capsys):
  r = _run(bank_scaling, [f"--config={TINY}", "--batch_size=2", "--sizes=1040,2080", "--tokens_per_chapter=0",
                          "--rounds=1", "--optimizer_reps=1", "--settle_s=0", *SHORT], capsys)
  assert [(s["chapters"], s["bank_optimizer"]) for s in r["sizes"]] == [
      (65, "dense"), (65, "lazy_adam"), (130, "dense"), (130, "lazy_adam")]
  assert r["sizes"][2]["bank_params"] == 2 * r["sizes"][0]["bank_params"]
  assert [s["router_params"] for s in r["sizes"]] == [65 * 65, 65 * 65, 130 * 65, 130 * 65]  # (d + 1) x C, one layer
  growth = r["growth"]["linear"]
  assert set(growth) == {"dense", "lazy_adam"} and r["pass"] == {"linear": growth["lazy_adam"]["step_growth"] <= 1.1}


@pytest.mark.slow
def test_bank_scaling_routers(capsys):
  """--routers: each (size, router) pair; the product router's weights grow as sqrt(chapters): 1 + 8 + 8 and
  1 + 12 + 11 outputs of d + 1 inputs at 65 and 130 chapters."""
  r = _run(bank_scaling, [f"--config={TINY}", "--batch_size=2", "--sizes=1040,2080", "--tokens_per_chapter=0",
                          "--rounds=1", "--optimizer_reps=1", "--settle_s=0", "--optimizers=lazy_adam",
                          "--routers=linear,product", *SHORT], capsys)
  assert [(s["chapters"], s["router"], s["router_params"]) for s in r["sizes"]] == [
      (65, "linear", 65 * 65), (65, "product", 17 * 65), (130, "linear", 130 * 65), (130, "product", 24 * 65)]
  assert set(r["growth"]) == {"linear", "product"} and set(r["pass"]) == {"linear", "product"}
  for bad in ("--routers=factorised", "--set=memory.router=product"):
    with pytest.raises(SystemExit) as e:
      bank_scaling.main([f"--config={TINY}", bad])
    assert e.value.code == 2


@pytest.mark.slow
def test_bank_scaling_product_keys(capsys):
  """--kind=pkm: sizes are value slots (n^2), each with its own sub-keys; a size that is not a square is refused."""
  r = _run(bank_scaling, [f"--config={TINY}", "--kind=pkm", "--batch_size=2", "--sizes=4096,16384", "--rounds=1",
                          "--optimizer_reps=1", "--settle_s=0", "--optimizers=lazy_adam", *SHORT], capsys)
  assert [(s["slots"], s["sub_keys"], s["bank_params"]) for s in r["sizes"]] == [(4096, 64, 4096 * 64),
                                                                                 (16384, 128, 16384 * 64)]
  g = r["growth"]["pkm"]["lazy_adam"]
  assert g["flops_growth"] > 1 and g["step_growth_over_flops"] == pytest.approx(g["step_growth"] / g["flops_growth"])
  assert r["pass"] == {"pkm": g["step_growth"] <= 1.1} and (r["top_k"], r["heads"]) == (8, 4)
  with pytest.raises(SystemExit) as e:
    bank_scaling.main([f"--config={TINY}", "--kind=pkm", "--sizes=5000"])
  assert e.value.code == 2


def test_xla_vs_analytic(capsys):
  # 4 layers: 2 scanned groups. MoC-PT's sequence routing, as the paper model's goal was set for: under tiny's
  # per-position routing at 32 tokens the XLA read pads each chapter's tile of pairs to 32 rows (kernels_pallas
  # xla.py) and computes ~1.7x the memory FLOPs the estimator counts as read.
  r = _run(xla_vs_analytic, [f"--config={TINY}", *SEQ32, "--set", "memory.routing=sequence"], capsys)
  assert r["pass"], r["relative"]  # tiny's forward is as close to the estimator as the paper model's
  # on a CPU the layer scan is unrolled: XLA counts every group's FLOPs, as in the unrolled model
  assert r["xla_forward_scanned"] == pytest.approx(r["xla_forward"], rel=1e-3)
  assert set(r["components"]) == {"self_attention", "mlp", "memory", "head"}


@pytest.mark.slow  # a profiled step end to end; its counting and timing rules: the tests below
def test_step_profile(capsys):
  r = _run(step_profile, [f"--config={TINY}", "--batch_size=2", "--steps=1", "--warmup=0", "--top=5", *SHORT], capsys)
  assert len(r["top"]) == 5 and r["top"][0]["ms"] >= r["top"][-1]["ms"]
  assert sum(c["s"] for c in r["categories"].values()) == pytest.approx(r["op_seconds_per_step"])
  assert r["matmul_flops_per_step"] > 0 and "matmul" in r["categories"]


def test_step_profile_counts_dot_flops_by_hand():
  """Every matmul of a compiled program is found (a bare dot or one inside a fusion) and counted 2*M*N*K."""
  a, b, c = (jax.ShapeDtypeStruct(s, jax.numpy.float32) for s in ((64, 32), (32, 48), (48, 16)))
  text = jax.jit(lambda a, b, c: jax.nn.relu(a @ b) @ c * 2.0).lower(a, b, c).compile().as_text()
  ops, computations = step_profile.parse_hlo(text)
  entry = computations[re.search(r"^ENTRY %?([\w.\-]+)", text, re.MULTILINE).group(1)]
  assert sum(step_profile.dot_flops(n, ops, computations) for n in entry) == 2 * 64 * 32 * 48 + 2 * 64 * 48 * 16


def test_step_profile_counts_each_op_its_own_time():
  """A loop's event encloses its body's: the loop keeps only the time outside them."""
  own = step_profile.self_times([(0, 10, "while"), (1, 4, "a"), (5, 9, "b"), (6, 7, "c"), (12, 15, "a")])
  assert own == {"while": 3, "a": 6, "b": 3, "c": 1}


@pytest.mark.slow
def test_routed_attention(capsys):
  # The timed part on tiny's memory layer at 2 x 32 tokens (4 compiles), and one compile-only variant.
  r = _run(routed_attention, ["--small_only", "--small_batch_size=2", "--small_seq_len=32", "--rounds=1",
                              "--calls_per_round=2", "--warmup=1"], capsys)
  small = r["small"]
  assert "large" not in r and set(small["variants"]) == {"naive", "sequence", "token_xla", "prefix_xla"}
  assert small["shape"]["tokens"] == 64 and small["shape"]["top_k"] == 8
  assert all(v["finite"] and v["step"]["n"] == 2 and v["step"]["median_s"] > 0 for v in small["variants"].values())
  med = {k: v["step"]["median_s"] for k, v in small["variants"].items()}
  assert small["time_token_xla_over_sequence"] == pytest.approx(med["token_xla"] / med["sequence"])
  assert small["time_naive_over_token_xla"] == pytest.approx(med["naive"] / med["token_xla"])
  met = small["time_token_xla_over_sequence"] <= 2.0
  assert r["goal_met"] == {"time_token_xla_over_sequence": met} and r["pass"] == met
  assert routed_attention.meets("temp_naive_over_token_xla", 19.9) is False
  assert routed_attention.meets("temp_token_xla_over_sequence", 1.5) is True
  assert routed_attention.meets("temp_token_xla_over_sequence", None) is None
  cfg = routed_attention.layer_config(TINY, "token", "xla")
  c = routed_attention.compile_variant(cfg, 2, 32)
  assert c["compiled"] and c["temp_bytes"] > 0 and c["argument_bytes"] > 0
  big = c["largest_values"][0]  # tiny's bank: [65, 16, 64] float32, or something larger
  assert big["bytes"] >= 65 * 16 * 64 * 4 and big["shape"].count(",") >= 1


@pytest.mark.parametrize("module, argv, error", [
    (cpu_peak, ["--dtype=int8"], "flag --dtype=int8: value should be one of"),
    (train_mfu, ["--set", "model.remat"], "--set 'model.remat': expected KEY=VALUE"),
    (moc_vs_vanilla, ["--rounds", "2", "3"], "not a flag: 3"),
    (bank_scaling, ["--sizes=4096,big"], "flag --sizes=4096,big: invalid literal for int()"),
    (bank_scaling, [f"--config={TINY}", "--optimizers=adam"], "flag --optimizers: 'adam' is not one of dense, lazy_adam"),
    (xla_vs_analytic, ["--no-scanned"], "Unknown command line flag 'no-scanned'"),
    (routed_attention, ["--variants=naive,fast"], "each variant is one of naive, sequence, token_xla, prefix_xla")])
def test_bad_flags_are_one_error_line(capsys, module, argv, error):
  with pytest.raises(SystemExit) as exit_info:
    module.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.startswith("error: ") and error in err and err.count("\n") == 1, err


def test_each_benchmark_has_its_own_flags(capsys):
  """Benchmarks imported together define --config each without clashing; --helpfull lists the command's own."""
  with pytest.raises(SystemExit) as exit_info:
    bank_scaling.main(["--helpfull"])
  out = capsys.readouterr().out
  assert exit_info.value.code == 0 and out.startswith(bank_scaling.__doc__)
  assert "--sizes" in out and "--config" in out and "--small_only" not in out


def test_each_call_parses_from_the_defaults():
  """main(argv) runs many times in one process: a flag a call does not give takes its default again."""
  assert cli.parse_command(bank_scaling._FLAGS, ["--sizes=8,16", "--set", "a=1"]).sizes == [8, 16]
  parsed = cli.parse_command(bank_scaling._FLAGS, [])
  assert parsed.sizes == [] and parsed.set == []  # empty: run() takes the kind's default sizes


class _Device:
  platform = "gpu"

  def __init__(self, kind):
    self.device_kind = kind


@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12), ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
    ("NVIDIA H100 PCIe", 756e12)])
def test_table_peaks(monkeypatch, kind, peak):
  monkeypatch.setattr(jax, "devices", lambda: [_Device(kind)])
  value, source = peaks.device_peak_flops("bfloat16")
  assert value == peak and source.startswith("table")
  assert peaks.device_peak_flops("float32")[0] is None  # only bf16 is tabulated


def test_unknown_device_has_no_peak(monkeypatch):
  monkeypatch.setattr(jax, "devices", lambda: [_Device("Quantum Abacus 9000")])
  value, reason = peaks.device_peak_flops()
  assert value is None and "unknown" in reason


def test_cpu_peak_cache_round_trip(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("MOC_JAX_CACHE_DIR", str(tmp_path))
  record = peaks.peak("float32", sizes=(64,), reps=1)
  assert record["flops_per_s"] > 0 and peaks.cache_path().startswith(str(tmp_path))
  stored = json.load(open(peaks.cache_path()))
  assert stored[peaks.cache_key("float32")] == record

  def no_measuring(*args, **kwargs):
    raise AssertionError("a cached peak must not be measured again")
  monkeypatch.setattr(peaks, "measure", no_measuring)
  assert peaks.peak("float32") == record
  assert peaks.device_peak_flops("float32")[0] == record["flops_per_s"]  # this test runs on the CPU
  out = cpu_peak.main(["--dtype=float32"])
  assert json.loads(capsys.readouterr().out) == out
  assert out["float32"]["gflops_per_s"] == pytest.approx(record["flops_per_s"] / 1e9)


@pytest.mark.slow
def test_step_ratio(capsys):
  """The first config is the unit; each row's FLOP ratio is the estimator's, and every config was timed as often."""
  r = _run(step_ratio, [f"--config={TINY}", "--config=configs/vanilla.py:tiny", "--batch_size=2", "--rounds=2",
                        "--steps_per_round=1", *SHORT], capsys)
  unit, vanilla = r["rows"]
  assert (unit["time_ratio"], unit["flop_ratio"]) == (1.0, 1.0)
  assert [row["step"]["n"] for row in r["rows"]] == [2, 2]
  # the same tokens per step: the ratio of model FLOPs per token, of each config as loaded with the flags
  per_token = {spec: flops.model_flops_per_token(common.load(spec, 2, common.parse_overrides(SHORT[1::2]))[0])
               for spec in (TINY, "configs/vanilla.py:tiny")}
  assert vanilla["flop_ratio"] == pytest.approx(per_token["configs/vanilla.py:tiny"] / per_token[TINY], rel=1e-9)
  assert vanilla["time_ratio"] == pytest.approx(vanilla["step"]["median_s"] / unit["step"]["median_s"])


@pytest.mark.slow  # two compiles; one size's ratios: test_step_ratio above
def test_step_ratio_at_several_batch_sizes(capsys):
  """Every config at every size, the unit the first config at the first size: a row's row_ratio is its time per row
  against the unit's, and its FLOP ratio is the estimator's per step (the bank's projections are once a micro-batch,
  so not twice at twice the rows)."""
  r = _run(step_ratio, [f"--config={TINY}", "--batch_size=1,2", "--rounds=1", "--steps_per_round=1", *SHORT], capsys)
  one, two = r["rows"]
  assert (one["batch_size"], two["batch_size"]) == (1, 2) and one["row_ratio"] == 1.0
  assert two["row_ratio"] == pytest.approx(two["step"]["median_s"] / 2 / one["step"]["median_s"])
  per_step = [common.analytic_train_flops_per_step(common.load(TINY, b, common.parse_overrides(SHORT[1::2]))[0])
              for b in (1, 2)]
  assert two["flop_ratio"] == pytest.approx(per_step[1] / per_step[0], rel=1e-9) and 1 < two["flop_ratio"] < 2


def test_step_ratio_needs_a_config(capsys):
  with pytest.raises(SystemExit) as exit_info:
    step_ratio.main([])
  assert exit_info.value.code == 2 and "--config: give at least one config spec" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    step_ratio.main([f"--config={TINY}", "--batch_size=32,0"])
  assert exit_info.value.code == 2 and "--batch_size=32,0: give sizes of at least 1" in capsys.readouterr().err


def test_input_pipeline(capsys):
  """Every config timed as often, its rates from its median batch time and its own batch shape."""
  r = _run(input_pipeline, [f"--config={TINY}", "--config=configs/vanilla.py:tiny", "--rounds=2",
                            "--batches_per_round=1", "--set", "data.seq_len=64"], capsys)
  assert [row["config"] for row in r["rows"]] == [TINY, "configs/vanilla.py:tiny"]
  for row in r["rows"]:
    data = common.load(row["config"], None, {"data.seq_len": 64})[0].data
    assert row["batch"]["n"] == 2
    assert row["tokens_per_s"] == pytest.approx(data.batch_size * 64 / row["batch"]["median_s"])
