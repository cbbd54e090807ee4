"""`python -m moc_jax.eval` on a saved run: the report against the training loop's evaluation, MCQ scoring
against a direct computation from the model's logits, recall buckets by hand, the run's config rebuilt
from config.json, bad input named with exit code 2, and (slow) checkpoints restored across meshes."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import sharding
from moc_jax.checkpoint import CheckpointError
from moc_jax.errors import ConfigError
from moc_jax.data import get_tokenizer, make_eval_batches
from moc_jax.errors import DataError
from moc_jax.eval import mcq, recall_by_bucket
from moc_jax.config import load_run_config
from moc_jax.eval.run import EvalOptions, markdown_table
from moc_jax.state import restore_params
from moc_jax.eval.scoring import Scorer, make_rows
from moc_jax import state as state_lib
from moc_jax.eval.validation import ValidationEvaluator
from tests.eval.eval_utils import save_run
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(REPO, "tests", "fixtures", "mcq")
FORMATS = {"arc": "arc", "boolq": "boolq", "openbookqa": "openbookqa", "mmlu": "mmlu", "hellaswag": "hellaswag"}
# batch divisible by 8 devices: the slow test restores this run on a data x memory mesh; MoC-PT's non-causal
# routing, one decision per row
EXTRA = {"train.batch_size": 8, "memory.routing": "sequence"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A saved tiny MoC run at step 2 (sequence routing; zero-initialised weights re-drawn so the memory
  reaches the loss) and the training loop's own evaluation of it: config, workdir, data dir, metrics."""
  data_dir, workdir = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("run")
  config = moc_jax.load_config("configs/moc.py:tiny", tu.overrides(data_dir, **EXTRA))
  layout, params = save_run(config, workdir)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    metrics = ValidationEvaluator(config, layout.graphdef, layout.shardings["params"],
                                  sharding.data_sharding(config, mesh))(params)
  return config, str(workdir), str(data_dir), metrics


def _cli(*args, env=None):
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "CI": "1", **(env or {})}
  return subprocess.run([sys.executable, "-m", "moc_jax.eval", *args], capture_output=True, text=True, cwd=REPO,
                        env=env, timeout=900)


def _last_eval(workdir):
  return [r for r in tu.read_metrics(workdir) if r.get("split") == "validation"][-1]


def test_cli_reports_the_training_evaluation_mcq_and_routing(run, tmp_path):
  config, workdir, _, last = run
  out = tmp_path / "report" / "eval.json"
  mcqs = ",".join(f"{name}:{FIX}/{name}.jsonl" for name in FORMATS)
  proc = _cli(f"--workdir={workdir}", f"--out={out}", f"--mcq={mcqs}", "--ablate_chapters=top:2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["step"] == 2 and report["devices"] == 1
  assert report["ce"] == pytest.approx(last["ce"], rel=1e-6) and report["tokens"] == last["tokens"]
  fr = report["fact_recall"]  # the same probes and parameters as the training loop's evaluation
  assert (fr["probe_acc"], fr["probe_exact"], fr["num_probes"]) == (last["probe_acc"], last["probe_exact"], 8)
  assert sum(b["probes"] for b in fr["buckets"]) == 8
  assert sum(b["acc"] * b["probes"] for b in fr["buckets"]) / 8 == pytest.approx(fr["probe_acc"])
  assert {name: r["format"] for name, r in report["mcq"].items()} == FORMATS
  assert [report["mcq"][n]["items"] for n in FORMATS] == [4, 3, 3, 3, 3]
  # the routing decisions: one per row holding a token (sequence routing), top_k routed chapters each
  d = state_lib.micro_batch_config(config)
  d.batch_size = 8
  rows = sum(int(b["attention_mask"].any(axis=1).sum()) for b in make_eval_batches(d, max_batches=2))
  for layer in report["routing"]["layers"]:
    assert layer["decisions"] == rows and sum(layer["counts"][1:]) == rows * config.memory.top_k
    assert layer["counts"][0] == 0  # the shared chapter is not counted
  assert [s["layer"] for s in report["routing"]["stability"]] == [1, 3]
  assert all(0 <= s["paraphrase_jaccard"] <= 1 for s in report["routing"]["stability"])
  ab = report["ablation"]
  assert ab["chapters"]["0"] and ab["ce"] != report["ce"]
  assert ab["fact_recall"]["num_probes"] == 8  # the same probes, scored without the ablated chapters
  assert ab["recall_delta"] == pytest.approx(ab["fact_recall"]["probe_acc"] - fr["probe_acc"])
  for key in ("routing_heatmap", "routing_usage"):
    assert open(report["files"][key], "rb").read(4) == b"\x89PNG"
    assert report["files"][key] in proc.stdout
  assert "| fact recall, likelihood choice" in proc.stdout and "| entity training docs |" in proc.stdout


@pytest.mark.slow  # the validation split evaluated twice more (the report's, and prefix-routed by hand)
def test_a_non_causal_run_also_reports_its_weights_routed_causally(run, tmp_path):
  """The report's causal CE is the CE of the same checkpoint with `memory.routing` overridden to `prefix`, as the
  training loop's evaluation of a prefix-routed run measures it; that causal evaluation reports no second figure."""
  from moc_jax.eval.run import evaluate
  config, workdir, _, last = run
  report = evaluate(config, workdir, EvalOptions(analyze_routing=False, out=str(tmp_path / "eval.json")))
  causal = report["causally_routed"]
  prefix = load_run_config(workdir, {"memory.routing": "prefix", "data.data_dir": config.data.data_dir})
  mesh = sharding.make_mesh(prefix)
  with sharding.activate(mesh, sharding.rules_of(prefix)):
    layout = state_lib.build_state(prefix, mesh)
    params, _ = restore_params(workdir, layout)
    want = ValidationEvaluator(prefix, layout.graphdef, layout.shardings["params"],
                               sharding.data_sharding(prefix, mesh))(params)
  assert report["ce"] == pytest.approx(last["ce"], rel=1e-6)  # its own, non-causal CE
  assert causal["routing"] == "prefix" and causal["ce"] == pytest.approx(want["ce"], rel=1e-6)
  assert causal["tokens"] == want["tokens"] == report["tokens"]
  # the two routings give different CEs: far beyond float32 rounding of a CE near 5.6 (6.7e-7); how far depends on
  # the memory's redrawn weights (a few 1e-5 at N(0, 0.02))
  assert abs(causal["ce"] - report["ce"]) > 1e-5 and causal["ce_delta"] == pytest.approx(causal["ce"] - report["ce"])
  assert f"| validation CE routed causally (`prefix`, same weights) | {causal['ce']:.4f} |" in markdown_table(report)
  again = evaluate(prefix, workdir, EvalOptions(analyze_routing=False, out=str(tmp_path / "prefix.json")))
  assert again["ce"] == pytest.approx(causal["ce"], rel=1e-6) and "causally_routed" not in again
  assert "routed causally" not in markdown_table(again)


def test_mcq_scores_equal_a_direct_computation_from_the_logits(run):
  """Each choice's log-likelihood from one forward pass per row (numpy log-softmax of the logits), the
  row padded to the width the scorer uses (sequence routing pools the padding) and cut to max_seq_len
  from the left; acc and acc_norm (per character) by hand."""
  config, workdir, _, _ = run
  tok = get_tokenizer(config.data.tokenizer)
  _, items = mcq.load(os.path.join(FIX, "arc.jsonl"))
  _, dev = mcq.load(os.path.join(FIX, "arc_dev.jsonl"))
  questions = mcq.with_shots(items, dev, 1)
  assert all(q[0].count("\n\n") == 1 and q[0].startswith("Question: ") for q in questions)
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    params, _ = restore_params(workdir, layout)
    scorer = Scorer(layout.graphdef)
    got = mcq.evaluate(scorer, params, questions, tok, config.model.max_seq_len)
    model = nnx.merge(layout.graphdef, params)
    forward = jax.jit(lambda ids, mask: model(ids, mask)[0])
  limit = config.model.max_seq_len
  rows = [((tok.encode(ctx) + tok.encode(" " + c))[-limit:], len(tok.encode(" " + c)))
          for ctx, choices, _ in questions for c in choices]
  width = -(-max(len(r) for r, _ in rows) // 16) * 16
  lls = []
  for row, n_cont in rows:
    ids = np.full((1, width), tok.pad_id, np.int32)
    mask = np.zeros((1, width), np.int32)
    ids[0, :len(row)], mask[0, :len(row)] = row, 1
    logits = np.asarray(forward(ids, mask), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    lls.append(sum(logp[t - 1, row[t]] for t in range(max(len(row) - n_cont, 1), len(row))))
  acc, acc_norm, i = [], [], 0
  for _, choices, gold in questions:
    ll = np.array(lls[i:i + len(choices)])
    acc.append(np.argmax(ll) == gold)
    acc_norm.append(np.argmax(ll / [len(c) for c in choices]) == gold)
    i += len(choices)
  with sharding.activate(mesh, sharding.rules_of(config)):
    rows_ll, _ = scorer(params, make_rows([(tok.encode(ctx), tok.encode(" " + c)) for ctx, cs, _ in questions
                                               for c in cs], tok.pad_id, limit))
  np.testing.assert_allclose(rows_ll, lls, rtol=2e-4)
  assert got["acc"] == np.mean(acc) and got["acc_norm"] == np.mean(acc_norm) and got["items"] == 4
  assert got["acc_stderr"] == pytest.approx(np.sqrt(np.mean(acc) * (1 - np.mean(acc)) / 4))
  assert got["truncated_rows"] == sum(len(tok.encode(ctx)) + len(tok.encode(" " + c)) > limit
                                      for ctx, cs, _ in questions for c in cs) > 0
  assert got["chance"] == pytest.approx(np.mean([1 / 4, 1 / 3, 1 / 5, 1 / 4]))


def test_mcq_formats_render_as_the_harness_does():
  (arc,), (boolq,), (obqa,), (mmlu,), (hs,) = (mcq.load(os.path.join(FIX, f"{n}.jsonl"))[1][:1] for n in FORMATS)
  assert (arc.context, arc.choices[arc.gold]) == ("Question: Which of these is a source of light?\nAnswer:", "the Sun")
  assert boolq.context.endswith("\nQuestion: is the sun a star?\nAnswer:") and boolq.choices == ("no", "yes")
  assert boolq.gold == 1
  assert (obqa.context, obqa.gold) == ("The moon is seen at night because it", 0)
  assert mmlu.context == "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:" and mmlu.choices == ("A", "B", "C", "D")
  assert mmlu.preamble == "The following are multiple choice questions (with answers) about elementary mathematics.\n\n"
  assert hs.context == "Making tea: A man fills a kettle with water. He" and hs.gold == 0
  assert hs.choices[2] == "paints the kettle. blue."  # " [title]" -> ". ", as lm-eval-harness cleans it
  assert mcq.load(os.path.join(FIX, "arc.jsonl"))[1][2].gold == 2  # numeric labels


@pytest.mark.parametrize("lines, match", [
    (['{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "A"}', '{"question": '],
     r"bad\.jsonl:2: not valid JSON"),
    (['{"prompt": "p", "target": "t"}'], r"bad\.jsonl:1: unknown multiple-choice format.*'prompt'.*arc: question"),
    (['{"question": "q", "choices": ["a", "b"], "answer": 5}'], r"bad\.jsonl:1: mmlu record: field 'answer' 5"),
    (['{"question": "q", "passage": "p", "answer": "yes"}'],
     r"bad\.jsonl:1: boolq record: field 'answer' must be true"),
    (['{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}'],
     r"bad\.jsonl:1: arc record: field 'answerKey' 'C' is not one of"),
    (['{"ctx": "c", "endings": ["a"]}'], r"bad\.jsonl:1: hellaswag record: missing field 'label'"),
    ([], r"holds no records"),
])
def test_bad_mcq_files_name_the_file_line_and_field(tmp_path, lines, match):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError, match=match):
    mcq.load(str(path))


def test_recall_buckets_by_hand():
  docs = [1, 2, 2, 3, 9, 10, 29, 30, 150, 1000, 5000]
  probes = [{"doc_count": d, "entity": f"e{d}"} for d in docs]
  correct = [1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
  exact = [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1]
  got = recall_by_bucket(probes, correct, exact)
  assert [(b["docs"], b["probes"], b["entities"]) for b in got] == [
      ("1-2", 3, 2), ("3-9", 2, 2), ("10-29", 2, 2), ("30-99", 1, 1), ("100-299", 1, 1), ("1000+", 2, 2)]
  assert [b["acc"] for b in got] == [2 / 3, 1.0, 0.0, 1.0, 1.0, 0.5]
  assert [b["exact"] for b in got] == [0.0, 0.5, 0.0, 0.0, 1.0, 0.5]
  assert got[0]["acc_stderr"] == pytest.approx(np.sqrt(2 / 3 * 1 / 3 / 3))
  coarse = recall_by_bucket(probes + [{"doc_count": 0, "entity": "x"}], correct + [0], exact + [0], edges=(5,))
  assert [(b["docs"], b["probes"], b["max_docs"]) for b in coarse] == [("0-4", 5, 4), ("5+", 7, None)]



def test_the_bucket_table_adds_the_ablated_recall():
  """With `--ablate_chapters`, each bucket's row also gives the same probes' recall with the chapters zeroed."""
  probes = [{"doc_count": d, "entity": f"e{d}"} for d in (10, 12, 500)]
  fr = {"num_probes": 3, "probe_chance": 0.25, "probe_acc": 1.0, "probe_acc_stderr": 0.0, "probe_exact": 0.0,
        "buckets": recall_by_bucket(probes, [1, 1, 1], [0, 0, 0])}
  report = {"workdir": "w", "step": 1, "config": "c", "devices": 1, "split": "validation", "ce": 1.0, "ppl": 2.7,
            "tokens": 3, "fact_recall": fr, "files": {}}
  plain = markdown_table(report).splitlines()
  assert "| 10-29 | 2 | 2 | 1.000 ± 0.000 | 0.000 |" in plain
  zeroed = {**fr, "buckets": recall_by_bucket(probes, [1, 0, 0], [0, 0, 0])}
  report["ablation"] = {"spec": "routed", "chapters": {"1": [1, 2]}, "ce": 1.5, "ce_delta": 0.5,
                        "fact_recall": zeroed}
  lines = markdown_table(report).splitlines()
  assert "| entity training docs | probes | entities | recall | exact match | recall, `routed` zeroed |" in lines
  assert "| 10-29 | 2 | 2 | 1.000 ± 0.000 | 0.000 | 0.500 ± 0.354 |" in lines
  assert "| 300-999 | 1 | 1 | 1.000 ± 0.000 | 0.000 | 0.000 ± 0.000 |" in lines

@pytest.mark.parametrize("bits", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_quantized_bank_report_equals_the_float_model_on_the_dequantized_bank(run, tmp_path, bits):
  """`--quantize_bank`: CE and recall of the codes against the training loop's evaluation of float params whose
  bank is dequantize(quantize(bank)); storage counted by hand (a byte per int8 code, half for int4, a float32
  scale per memory token)."""
  config, workdir, _, _ = run
  from moc_jax.model import quantize
  from moc_jax.eval.run import evaluate
  report = evaluate(config, workdir, EvalOptions(quantize_bank=bits, analyze_routing=False,
                                                 out=str(tmp_path / "eval.json")))
  q = report["quantized_bank"]
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    params, _ = restore_params(workdir, layout)
    bank = np.asarray(params["bank"]["memory"][...])
    n = 8 if bits == "int8" else 4
    params["bank"]["memory"].set_value(jax.device_put(np.asarray(quantize.dequantize_rows(
        *quantize.quantize_rows(bank, n), n)), params["bank"]["memory"][...].sharding))
    want = ValidationEvaluator(config, layout.graphdef, layout.shardings["params"],
                          sharding.data_sharding(config, mesh))(params)
  assert q["ce"] == pytest.approx(want["ce"], rel=1e-6) and q["ce"] != report["ce"]
  assert q["ce_delta"] == pytest.approx(q["ce"] - report["ce"])
  assert q["fact_recall"]["probe_acc"] == want["probe_acc"]
  rows, d = bank.size // bank.shape[-1], bank.shape[-1]
  assert (q["bank_bytes"], q["float_bank_bytes"]) == (rows * d * n // 8 + 4 * rows, 4 * rows * d)
  assert f"{bits} bank" in markdown_table(report)


def test_run_config_is_rebuilt_from_config_json_with_overrides(run, tmp_path):
  config, workdir, _, _ = run
  rebuilt = load_run_config(workdir, {"data.data_dir": "/elsewhere", "train.eval_batches": 1})
  want = config.to_dict()
  got = rebuilt.to_dict()
  assert got["data"].pop("data_dir") == "/elsewhere" and got["train"].pop("eval_batches") == 1
  want["data"].pop("data_dir"), want["train"].pop("eval_batches")
  assert got == want  # every field, tuples included
  saved = json.loads(open(os.path.join(workdir, "config.json")).read())
  saved["mesh"] = {"data": 2, "memory": 4, "fsdp": 1, "tensor": 1}
  saved["num_fake_devices"], saved["retired_field"] = 8, 1
  (tmp_path / "config.json").write_text(json.dumps(saved))
  moved = load_run_config(str(tmp_path))  # mesh reset to this machine's devices; unknown fields ignored
  assert moved.mesh.to_dict() == {"data": -1, "memory": 1, "fsdp": 1, "tensor": 1} and moved.num_fake_devices == 0
  assert load_run_config(str(tmp_path), {"mesh.memory": 4}).mesh.memory == 4
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match="config.json is not valid JSON"):
    load_run_config(str(tmp_path))
  with pytest.raises(ConfigError, match="does not exist"):
    load_run_config(str(tmp_path / "missing"))
  with pytest.raises(ConfigError, match="config.json not found"):
    load_run_config(str(tmp_path.parent))


def test_missing_checkpoints_and_steps_are_named(run, tmp_path):
  config, workdir, _, _ = run
  mesh = sharding.make_mesh(config)
  layout = state_lib.build_state(config, mesh)
  with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .*saved steps: \[2\]"):
    restore_params(workdir, layout, step=7)
  with pytest.raises(CheckpointError, match="no checkpoint found"):
    restore_params(str(tmp_path), layout)
  from moc_jax.eval.run import _mcq_questions
  with pytest.raises(DataError, match="--shots 2 needs k-shot examples for 'arc': add --mcq_dev=arc:PATH"):
    _mcq_questions(EvalOptions(mcq={"arc": os.path.join(FIX, "arc.jsonl")}, shots=2))
  with pytest.raises(DataError, match="is arc, but .* is boolq"):
    _mcq_questions(EvalOptions(mcq={"b": os.path.join(FIX, "boolq.jsonl")},
                               mcq_dev={"b": os.path.join(FIX, "arc.jsonl")}, shots=1))


def test_bad_input_exits_with_code_2_and_one_message(run, tmp_path):
  _, workdir, _, _ = run
  (tmp_path / "bad.jsonl").write_text('{"question": "q"}\n{oops\n')
  proc = _cli(f"--workdir={workdir}", f"--mcq=x:{tmp_path / 'bad.jsonl'}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "bad.jsonl:1: unknown multiple-choice format" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_checkpoints_restore_across_meshes(run, tmp_path):
  """Trained on 8 fake devices (data 2 x memory 4, chapters padded 65 -> 68) and evaluated on one; saved
  on one and evaluated on 8: CE and recall as the training loop measured them."""
  _, workdir, data_dir, metrics = run
  xla = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  mesh8 = ["--config.num_fake_devices=8", "--config.mesh.data=2", "--config.mesh.memory=4"]
  on8 = tmp_path / "on8"
  args = tu.cli_args("configs/moc.py:tiny", data_dir, on8, **EXTRA)
  train = subprocess.run([sys.executable, "-m", "moc_jax.main", *args, *mesh8], capture_output=True, text=True,
                         cwd=REPO, timeout=900,
                         env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "CI": "1", **xla})
  assert train.returncode == 0, train.stderr[-3000:]
  for source, flags, env, devices, want in ((str(on8), [], None, 1, _last_eval(on8)),
                                           (workdir, mesh8, xla, 8, metrics)):
    proc = _cli(f"--workdir={source}", f"--out={tmp_path / f'{devices}.json'}", *flags, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / f"{devices}.json").read_text())
    assert report["devices"] == devices and report["step"] == 2
    assert report["ce"] == pytest.approx(want["ce"], rel=1e-5)
    assert report["fact_recall"]["probe_acc"] == want["probe_acc"]
    assert len(report["routing"]["layers"][0]["counts"]) == 65  # the user view: padding never shows
