"""`python -m moc_jax.convert.mocpt`: MoC-PT weights and config become a workdir whose config and parameters,
restored as `--mode=eval` and `python -m moc_jax.eval` restore them, reproduce MoC-PT's logits on the parity
fixtures (one device, and the bank sharded over 4); bad inputs fail clearly."""
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

import moc_jax
from moc_jax import checkpoint as ckpt_lib
from moc_jax import sharding
from moc_jax.errors import ConfigError
from moc_jax.convert import mocpt
from moc_jax.config import load_run_config
from moc_jax.state import build_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
TOLERANCE = 1e-5
F32 = {"model.compute_dtype": "float32"}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _fixture(name):
  fx = np.load(os.path.join(FIXTURES, name))
  return fx, json.loads(str(fx["meta_json"]))


def _state(fx):
  return {k.removeprefix("param/"): fx[k] for k in fx.files if k.startswith("param/")}


def _write_config(path, meta, **model):
  sections = {"model": {**meta["model"], **model}, "memory": meta["memory"]}
  with open(path, "w") as f:
    if str(path).endswith(".json"):
      json.dump(sections, f)
    else:
      yaml.safe_dump(sections, f)
  return str(path)


def _import(capsys, *args):
  try:
    code = mocpt.main([str(a) for a in args])
  except SystemExit as e:  # bad input: one error line, exit code 2
    code = e.code
  out = capsys.readouterr()
  return code, out.out + out.err


def _rel(ours, theirs):
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def _eval_logits(config, run, fx, repeat=1):
  """Logits of the newest checkpoint in `run`, restored as the evaluations do (build_state + restore_params),
  on the fixture's batch repeated `repeat` times (rows are independent)."""
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    params, step = ckpt_lib.restore_params(run, layout.abstract["params"], padding=layout.padding)
    ids, mask = (jnp.asarray(np.tile(fx[k], (repeat, 1))) for k in ("input_ids", "attention_mask"))
    forward = jax.jit(lambda p, ids, mask: nnx.merge(layout.graphdef, p)(ids, mask, train=False)[0])
    logits = forward.lower(params, ids, mask).compile(compiler_options=FAST_COMPILE)(params, ids, mask)
  return logits, step, layout.padding


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """Both fixtures imported: the sequence one from a bare .npz and a YAML, the token one straight from
  the fixture file (names under `param/`) and a JSON config."""
  runs = {}
  root = tmp_path_factory.mktemp("import")
  fx, meta = _fixture("moc_pt_paper_small.npz")
  np.savez(root / "model.npz", **_state(fx))
  runs["sequence"] = ("moc_pt_paper_small.npz", root / "model.npz",
                      _write_config(root / "their.yaml", meta), root / "run_sequence")
  _, meta = _fixture("moc_pt_token_small.npz")
  runs["token"] = ("moc_pt_token_small.npz", os.path.join(FIXTURES, "moc_pt_token_small.npz"),
                   _write_config(root / "their.json", meta), root / "run_token")
  for name, state_dict, config, run in runs.values():
    assert mocpt.main(["--state_dict", str(state_dict), "--config", config, "--out", str(run), "--step", "7"]) == 0
  return {k: (name, config, str(run)) for k, (name, _, config, run) in runs.items()}


@pytest.mark.parametrize("routing", ["sequence", "token"])
def test_import_reproduces_mocpt_logits(imported, routing):
  """config.json is the config `--config=configs/mocpt.py:THEIRS,import` gives (what `python -m moc_jax.main
  --mode=eval` runs under) and `python -m moc_jax.eval --workdir` rebuilds; its restored params give
  MoC-PT's logits."""
  name, config_path, run = imported[routing]
  fx, _ = _fixture(name)
  theirs = moc_jax.load_config(f"configs/mocpt.py:{config_path},import", F32)
  written = json.load(open(os.path.join(run, "config.json")))
  assert written == json.loads(mocpt.load_mocpt_config(config_path).to_json_best_effort())  # as training writes it
  assert written["model"]["compute_dtype"] == "bfloat16"  # MoC-PT's bf16 autocast by default
  assert written["memory"]["routing"] == routing
  rebuilt = load_run_config(run, F32)
  moc_jax.validate(rebuilt)
  assert rebuilt.to_dict() == theirs.to_dict()
  assert sorted(os.listdir(os.path.join(run, "checkpoints", "7"))) == [
      "_CHECKPOINT_METADATA", "commit_success.txt", "params"]  # weights only
  logits, step, padding = _eval_logits(rebuilt, run, fx)
  assert step == 7 and not padding.active
  assert _rel(logits, fx["logits"]) <= TOLERANCE


_MESH_SCRIPT = """
import sys, jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
import moc_jax
from tests.convert.test_import import _eval_logits, _fixture, _rel, F32
for name, config_path, run in zip(*[iter(sys.argv[1:])] * 3):
  fx, _ = _fixture(name)
  config = moc_jax.load_config(f"configs/mocpt.py:{config_path}", {**F32, "mesh.memory": 4})
  logits, _, padding = _eval_logits(config, run, fx, repeat=4)
  print(name, padding.real, padding.padded, _rel(logits, np.tile(fx["logits"], (4, 1, 1))))
"""


def test_import_restores_onto_a_chapter_sharded_mesh(imported):
  """4 devices, bank chapters sharded 4 ways: 17 chapters padded to 20 on restore, same logits (the batch,
  split over the same devices, repeated to 12 rows)."""
  args = [x for k in ("sequence", "token") for x in imported[k]]
  out = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.split() for line in out.stdout.splitlines()]
  assert len(rows) == 2
  for name, real, padded, err in rows:
    assert (int(real), int(padded)) == (17, 20) and float(err) <= TOLERANCE, (name, err)


@pytest.fixture
def paper(tmp_path):
  fx, meta = _fixture("moc_pt_paper_small.npz")
  return _state(fx), meta, _write_config(tmp_path / "their.yaml", meta)


def test_mismatched_tensors_are_all_listed(paper, tmp_path, capsys):
  state, _, config = paper
  state = dict(state)
  del state["layers.2.mlp.up_proj.weight"]
  state["layers.9.mlp.up_proj.weight"] = state["layers.1.mlp.up_proj.weight"]
  state["layers.0.self_attn.k_proj.weight"] = state["layers.0.self_attn.k_proj.weight"].T
  np.savez(tmp_path / "bad.npz", **state)
  code, out = _import(capsys, "--state_dict", tmp_path / "bad.npz", "--config", config, "--out", tmp_path / "run")
  assert code == 2
  assert "missing 1: layers.2.mlp.up_proj.weight" in out
  assert "unexpected 1: layers.9.mlp.up_proj.weight" in out
  assert "mis-shaped 1: layers.0.self_attn.k_proj.weight (64, 32) (expected (32, 64))" in out
  assert not os.path.exists(tmp_path / "run")  # nothing written


def test_weights_of_another_architecture_are_refused(paper, tmp_path, capsys):
  state, meta, _ = paper
  np.savez(tmp_path / "model.npz", **state)
  config = _write_config(tmp_path / "other.yaml", meta, num_layers=6, intermediate_dim=96)
  code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config, "--out", tmp_path / "run")
  assert code == 2 and "missing 18: layers.4.input_layernorm.weight" in out
  assert "mis-shaped 12:" in out and "layers.0.mlp.down_proj.weight (64, 128) (expected (64, 96))" in out


def test_untied_head_and_wrong_rope_buffers_are_refused(paper, tmp_path, capsys):
  state, _, config = paper
  for key, value, message in [("lm_head.weight", state["lm_head.weight"] + 1, "lm_head.weight differs"),
                              ("layers.1.self_attn.rotary.inv_freq", state["layers.1.self_attn.rotary.inv_freq"] * 2,
                               "does not match rope_theta")]:
    np.savez(tmp_path / "model.npz", **{**state, key: value})
    code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config, "--out", tmp_path / "run")
    assert code == 2 and message in out


def test_unsupported_config_names_the_field(paper, tmp_path, capsys):
  state, meta, _ = paper
  np.savez(tmp_path / "model.npz", **state)
  config = _write_config(tmp_path / "rope.yaml", meta, use_rope=False)
  code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config, "--out", tmp_path / "run")
  assert code == 2 and "model.use_rope" in out


def test_a_config_without_training_length_evaluates_at_a_length_the_model_runs(tmp_path, caplog):
  """Without training.max_length, an import takes min(model max_seq_len, 2048) — not MoC-PT's training
  default 8192, which pads every evaluation row to 8192 tokens — with one warning naming the field and the value;
  a length the file gives is kept, silently; training from the same YAML keeps MoC-PT's default."""
  _, meta = _fixture("moc_pt_paper_small.npz")
  bare = _write_config(tmp_path / "bare.yaml", meta, max_seq_len=8192, max_position_embeddings=None)
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    assert mocpt.load_mocpt_config(bare).data.seq_len == 2048
  assert [r.getMessage() for r in caplog.records if "training.max_length" in r.getMessage()] == [
      f"MoC-PT config {bare} sets no training.max_length (default 8192): data.seq_len=2048 used for the imported "
      "run (set training.max_length in the file, or --config.data.seq_len=N when evaluating)"]
  assert moc_jax.load_config(f"configs/mocpt.py:{bare}").data.seq_len == 8192
  caplog.clear()
  given = tmp_path / "given.yaml"
  given.write_text(open(bare).read() + "training:\n  max_length: 4096\n")
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    assert mocpt.load_mocpt_config(str(given)).data.seq_len == 4096
  assert "training.max_length" not in caplog.text


def test_the_tokenizer_is_checked_against_the_imported_vocabulary(paper, tmp_path, capsys, caplog, hf_path):
  """--tokenizer with more ids than model.vocab_size (97) is refused in one line, nothing written; without it
  the byte tokenizer (260 ids) stays in config.json with one warning naming both numbers."""
  state, _, config = paper
  np.savez(tmp_path / "model.npz", **state)
  code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config, "--out", tmp_path / "a",
                      "--tokenizer", f"hf:{hf_path}")
  assert code == 2 and out.startswith("error: config.data.tokenizer") and "vocab_size is 97" in out, out
  assert not os.path.exists(tmp_path / "a")
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config, "--out", tmp_path / "b")
  assert code == 0, out
  assert "MoC-PT model.vocab_size=97 but data.tokenizer='byte' has 260 ids" in caplog.text
  assert json.load(open(tmp_path / "b" / "config.json"))["data"]["tokenizer"] == "byte"


def test_inference_routing_maps_to_cached_decoding(tmp_path):
  """MoC-PT's cache-only inference strategies (rolling, hybrid: `sequence` without a cache) become
  memory.decode_routing with their window; an inference routing that changes the forward is refused."""
  _, meta = _fixture("moc_pt_paper_small.npz")
  for infer, window in (("rolling", 64), ("hybrid", 32)):
    path = tmp_path / f"{infer}.yaml"
    _write_config(path, {**meta, "memory": {**meta["memory"], "routing_strategy_inference": infer,
                                            "routing_window_size": window}})
    c = mocpt.load_mocpt_config(str(path))
    assert (c.memory.routing, c.memory.decode_routing, c.memory.routing_window) == ("sequence", infer, window)
  assert mocpt.load_mocpt_config(_write_config(tmp_path / "seq.yaml", meta)).memory.decode_routing == "auto"
  bad = {**meta["memory"], "routing_strategy_train": "token", "routing_strategy_inference": "rolling"}
  with pytest.raises(ConfigError, match="routing_strategy_train='token', _inference='rolling'"):
    mocpt.load_mocpt_config(_write_config(tmp_path / "bad.yaml", {**meta, "memory": bad}))


def test_existing_checkpoints_are_not_overwritten(imported, paper, tmp_path, capsys):
  state, _, config = paper
  np.savez(tmp_path / "model.npz", **state)
  code, out = _import(capsys, "--state_dict", tmp_path / "model.npz", "--config", config,
                      "--out", imported["sequence"][2])
  assert code == 2 and "already holds checkpoints" in out


@pytest.mark.parametrize("ext, module, hint", [(".pt", "torch", "pip install torch"),
                                               (".safetensors", "safetensors", "pip install safetensors")])
def test_missing_optional_reader_names_the_package(paper, tmp_path, capsys, monkeypatch, ext, module, hint):
  _, _, config = paper
  (tmp_path / f"model{ext}").write_bytes(b"")
  monkeypatch.setitem(sys.modules, module, None)  # as if not installed
  monkeypatch.setitem(sys.modules, f"{module}.numpy", None)
  code, out = _import(capsys, "--state_dict", tmp_path / f"model{ext}", "--config", config, "--out", tmp_path / "run")
  assert code == 2 and hint in out


def test_unknown_format_and_missing_files(paper, tmp_path, capsys):
  _, _, config = paper
  (tmp_path / "model.ckpt").write_bytes(b"")
  code, out = _import(capsys, "--state_dict", tmp_path / "model.ckpt", "--config", config, "--out", tmp_path / "run")
  assert code == 2 and "unknown format '.ckpt'" in out
  code, out = _import(capsys, "--state_dict", tmp_path / "model.ckpt", "--config", tmp_path / "no.yaml",
                      "--out", tmp_path / "run")
  assert code == 2 and "no.yaml: no such file" in out


@pytest.mark.parametrize("args, error", [
    (["--state_dict", "model.npz", "--config", "their.yaml"], "error: flag --out=None: Flag --out must have a value"),
    (["--state_dict", "model.npz", "--config", "their.yaml", "--out", "run", "--step", "-1"],
     "error: flag --step=-1: -1 is not a non-negative integer"),
    (["--state_dict", "model.npz", "--config", "their.yaml", "--out", "run", "--steps=7"],
     "error: Unknown command line flag 'steps'")])
def test_bad_flags_are_one_error_line(capsys, args, error):
  code, out = _import(capsys, *args)
  assert code == 2 and out.startswith(error) and out.count("\n") == 1, out


def test_safetensors_file(paper, tmp_path):
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  state, _, _ = paper
  safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, tmp_path / "model.safetensors")
  loaded = mocpt.read_state_dict(str(tmp_path / "model.safetensors"))
  assert loaded.keys() == state.keys() and all(np.array_equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("wrapper, dtype", [(None, "bfloat16"), ("model_state_dict", "float32")])
def test_torch_checkpoint(paper, tmp_path, wrapper, dtype):
  """model.pt as MoC-PT's trainer saves it (the bare state_dict; bf16 with `save_precision: bf16`), or
  wrapped as its utils.save_checkpoint does; a bf16 file imports (its inv_freq checked to bf16 precision)."""
  torch = pytest.importorskip("torch")
  state, _, config = paper
  tensors = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in state.items()}
  torch.save(tensors if wrapper is None else {wrapper: tensors, "step": 3}, tmp_path / "model.pt")
  loaded = mocpt.read_state_dict(str(tmp_path / "model.pt"))
  assert loaded.keys() == state.keys()
  for k, v in state.items():
    assert loaded[k].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(loaded[k], v.astype(loaded[k].dtype))
  assert mocpt.main(["--state_dict", str(tmp_path / "model.pt"), "--config", config,
                     "--out", str(tmp_path / "run")]) == 0


@pytest.mark.slow
def test_imported_workdir_trains_via_init_from_not_in_place(tmp_path):
  """Weights only: `--config.train.init_from=DIR` trains from them (its step-0 evaluation is the
  imported model's); training in DIR itself stops with a CheckpointError naming the missing item."""
  from moc_jax.eval import evaluate
  from moc_jax.main import train
  from tests.train import train_utils as tu
  fx, meta = _fixture("moc_pt_paper_small.npz")
  config_path = _write_config(tmp_path / "their.yaml", meta, vocab_size=260)  # the byte tokenizer's
  config = mocpt.load_mocpt_config(config_path)
  model = moc_jax.build_model(config, seed=3)
  np.savez(tmp_path / "model.npz", **mocpt.to_mocpt(config, nnx.state(model, nnx.Param).to_pure_dict()))
  assert mocpt.main(["--state_dict", str(tmp_path / "model.npz"), "--config", config_path,
                     "--out", str(tmp_path / "run")]) == 0
  overrides = tu.overrides(tmp_path / "data")
  config = moc_jax.load_config(f"configs/mocpt.py:{config_path}", overrides)
  imported = evaluate(config, str(tmp_path / "run"))
  config = moc_jax.load_config(f"configs/mocpt.py:{config_path}",
                               {**overrides, "train.init_from": str(tmp_path / "run")})
  train(config, str(tmp_path / "finetune"))
  first_eval = next(r for r in tu.read_metrics(tmp_path / "finetune") if r.get("split") == "validation")
  assert first_eval["step"] == 0 and first_eval["ce"] == pytest.approx(imported["ce"], rel=1e-6)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"no opt_state, step, data_iter, rng .*init_from=<this workdir>"):
    train(config, str(tmp_path / "run"))
