"""experiments/records.py: a study's finished runs kept without their checkpoints, its stopped runs with their newest,
and put back into a directory that lost them; a stopped run restored resumes on the curve of one never stopped; the
capacity study carried over a lost DIR with training faked (tests/experiments/test_capacity.py's fake) trains nothing
twice and reports the same."""
import gzip
import json
import logging
import os
import shutil

import pytest

from experiments import capacity, evaluation, records
from experiments.sweeps.runs import latest_checkpoint, read_manifest, write_manifest
from moc_jax.errors import UsageError

from tests.experiments.test_capacity import SPEC, faked  # noqa: F401  (a fixture)

METRICS = [{"step": 0, "split": "validation", "probe_acc": 0.25, "ce": 2.0},
           {"step": 8, "loss": 1.5}, {"step": 16, "split": "validation", "probe_acc": 0.6, "ce": 1.0}]


def _run(sweep_dir, name, status="done", steps=16, checkpoint=True, spec=SPEC):
  """A run as the launcher leaves it: config.json, metrics.jsonl (its last evaluation at `steps` if done), a
  checkpoint of its last step (of step 8 if stopped) unless `checkpoint` is False, an eval.json; and its manifest
  entry."""
  workdir = os.path.join(sweep_dir, name)
  os.makedirs(workdir)
  if checkpoint:
    os.makedirs(os.path.join(workdir, "checkpoints", str(steps if status == "done" else 8)))
  rows = METRICS if status == "done" else METRICS[:2]
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  for file, text in {"config.json": '{"name": "%s"}' % name, "eval.json": "{}", "sweep.log": "log"}.items():
    with open(os.path.join(workdir, file), "w") as f:
      f.write(text)
  entry = {"name": name, "workdir": workdir, "status": status, "steps": steps, "wall_s": 12.5, "attempts": 2,
           "config": spec, "sweep": os.path.basename(sweep_dir)}
  write_manifest(sweep_dir, [*read_manifest(sweep_dir), entry])
  return workdir


def _done(workdir, entry):
  return entry["status"] == "done"


def test_a_saved_run_comes_back_whole_without_its_checkpoints(tmp_path):
  out, kept, again = tmp_path / "dir", tmp_path / "records", tmp_path / "again"
  workdir = _run(str(out / "gate"), "narrow")
  _run(str(out / "gate"), "wide", status="pending", checkpoint=False)  # stopped before its first checkpoint
  assert records.save(str(out), str(kept), ["preflight", "gate"], _done) == 1
  assert sorted(os.listdir(kept / "gate")) == ["manifest.jsonl", "narrow"]
  assert sorted(os.listdir(kept / "gate" / "narrow")) == ["config.json", "eval.json", "metrics.jsonl.gz"]
  assert [e["workdir"] for e in read_manifest(str(kept / "gate"))] == ["narrow"]  # relative: any DIR
  assert records.restore(str(kept), str(again), ["preflight", "gate"], SPEC) == 1
  back = again / "gate" / "narrow"
  assert (back / "metrics.jsonl").read_bytes() == open(os.path.join(workdir, "metrics.jsonl"), "rb").read()
  assert (back / "config.json").read_text() == '{"name": "narrow"}' and not (back / "checkpoints").exists()
  [entry] = read_manifest(str(again / "gate"))
  assert entry["workdir"] == str(back) and (entry["wall_s"], entry["attempts"], entry["status"]) == (12.5, 2, "done")


def test_saving_again_changes_no_byte_and_keeps_runs_recorded_before(tmp_path):
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow")
  records.save(str(out), str(kept), ["gate"], _done)
  packed = (kept / "gate" / "narrow" / "metrics.jsonl.gz").read_bytes()
  assert gzip.decompress(packed).decode().count("\n") == 3
  shutil.rmtree(out)  # a new part on a machine that kept nothing: another run finished there
  _run(str(out / "gate"), "wide")
  assert records.save(str(out), str(kept), ["gate"], _done) == 1
  assert (kept / "gate" / "narrow" / "metrics.jsonl.gz").read_bytes() == packed
  assert sorted(e["name"] for e in read_manifest(str(kept / "gate"))) == ["narrow", "wide"]
  assert records.save(str(out), str(kept), ["gate"], _done) == 0


def test_a_run_dir_holds_is_never_overwritten_by_the_record(tmp_path):
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow")
  records.save(str(out), str(kept), ["gate"], _done)
  shutil.rmtree(out / "gate")
  resuming = _run(str(out / "gate"), "narrow", status="pending")  # DIR's own attempt, stopped at a checkpoint
  assert records.restore(str(kept), str(out), ["gate"], SPEC) == 0
  assert os.path.isdir(os.path.join(resuming, "checkpoints", "8"))
  assert [e["status"] for e in read_manifest(str(out / "gate"))] == ["pending"]


def test_a_stopped_run_is_kept_with_its_newest_checkpoint_until_it_is_complete(tmp_path):
  out, kept, again = tmp_path / "dir", tmp_path / "records", tmp_path / "again"
  workdir = _run(str(out / "gate"), "narrow", status="pending")
  os.makedirs(os.path.join(workdir, "checkpoints", "4"))  # an older step beside the newest, 8
  (tmp_path / "step8").write_text("state at 8")
  shutil.copy(tmp_path / "step8", os.path.join(workdir, "checkpoints", "8", "state"))
  assert records.save(str(out), str(kept), ["gate"], _done) == 0  # not complete: none newly recorded complete
  assert os.listdir(kept / "gate" / "narrow" / "checkpoints") == ["8"]
  [entry] = read_manifest(str(kept / "gate"))
  assert (entry["status"], entry["wall_s"], entry["attempts"]) == ("pending", 12.5, 2)
  assert records.restore(str(kept), str(again), ["gate"], SPEC) == 1
  back = again / "gate" / "narrow"
  assert (back / "checkpoints" / "8" / "state").read_text() == "state at 8" and latest_checkpoint(str(back)) == 8
  assert [e["status"] for e in read_manifest(str(again / "gate"))] == ["pending"]
  os.makedirs(back / "checkpoints" / "16")  # the next part: on from step 8, then to its end
  with open(back / "metrics.jsonl", "a") as f:
    f.write(json.dumps(METRICS[2]) + "\n")
  entries = read_manifest(str(again / "gate"))
  write_manifest(str(again / "gate"), [{**entries[0], "status": "done"}])
  assert records.save(str(again), str(kept), ["gate"], _done) == 1
  assert sorted(os.listdir(kept / "gate" / "narrow")) == ["config.json", "eval.json", "metrics.jsonl.gz"]
  assert [e["status"] for e in read_manifest(str(kept / "gate"))] == ["done"]


def test_a_complete_record_is_never_replaced_by_a_stopped_run(tmp_path):
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow")
  records.save(str(out), str(kept), ["gate"], _done)
  packed = (kept / "gate" / "narrow" / "metrics.jsonl.gz").read_bytes()
  shutil.rmtree(out)
  _run(str(out / "gate"), "narrow", status="pending")  # trained again elsewhere, and stopped
  assert records.save(str(out), str(kept), ["gate"], _done) == 0
  assert (kept / "gate" / "narrow" / "metrics.jsonl.gz").read_bytes() == packed
  assert not (kept / "gate" / "narrow" / "checkpoints").exists()
  assert [e["status"] for e in read_manifest(str(kept / "gate"))] == ["done"]


def test_a_stopped_run_restored_from_its_record_resumes_on_the_curve_of_one_never_stopped(tmp_path, caplog):
  """A real run stopped after its checkpoint at step 2 (a finished run cut back to that state: its later steps and
  rows gone, as a stop leaves it), kept, its DIR lost, restored elsewhere and trained on: the losses and evaluations
  of the run never stopped, to the bit."""
  import moc_jax
  from moc_jax import main as main_lib
  from tests.train import train_utils as tu
  data, sweep = tmp_path / "data", tmp_path / "dir" / "arms"
  workdir = sweep / "dense"
  config = moc_jax.load_config("configs/vanilla.py:tiny", tu.overrides(data, **{"train.steps": 6}))
  main_lib.train(config, str(workdir))
  whole = tu.read_metrics(workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  shutil.rmtree(workdir / "checkpoints" / "6")
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in whole if r["step"] <= 3))
  write_manifest(str(sweep), [{"name": "dense", "workdir": str(workdir), "status": "pending", "steps": 6,
                               "wall_s": 1.0, "attempts": 1, "config": SPEC, "sweep": "arms"}])
  records.save(str(tmp_path / "dir"), str(tmp_path / "records"), ["arms"], _done)
  shutil.rmtree(tmp_path / "dir")
  assert records.restore(str(tmp_path / "records"), str(tmp_path / "again"), ["arms"], SPEC) == 1
  resumed = tmp_path / "again" / "arms" / "dense"
  with caplog.at_level(logging.WARNING, logger="moc_jax"):
    main_lib.train(config, str(resumed))
  assert f"resumed {resumed} from step 2" in caplog.text  # not trained again from step 0
  losses = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "split" not in r]  # noqa: E731
  evals = lambda rows: [(r["step"], r["ce"], r.get("probe_acc")) for r in rows if r.get("split")]  # noqa: E731
  again = tu.read_metrics(resumed)
  assert losses(again) == losses(whole) and len(losses(whole)) == 6
  assert evals(again) == evals(whole) and len(evals(whole)) >= 3


def test_a_record_of_another_config_is_one_error_and_nothing_is_copied(tmp_path):
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow", spec="configs/capacity.py:moc,words")
  records.save(str(out), str(kept), ["gate"], _done)
  with pytest.raises(UsageError, match=r"^--records=.*: its sweep gate holds runs of "
                     r"--config=configs/capacity.py:moc,words, not configs/capacity.py:moc; pass that --config"):
    records.restore(str(kept), str(tmp_path / "new"), ["gate"], SPEC)
  assert not (tmp_path / "new").exists()


def test_a_field_added_after_a_run_was_recorded_counts_as_its_default(tmp_path):
  """config.json of a run trained before moc_jax had data.cluster.words lacks it: the run was trained with its
  default (0, no first-words tree), and a study asking for 2 is refused."""
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow")
  records.save(str(out), str(kept), ["gate"], _done)
  now = {"name": "narrow", "data": {"cluster": {"words": 0}}}
  assert records.restore(str(kept), str(tmp_path / "same"), ["gate"], SPEC, {("gate", "narrow"): now})
  now["data"]["cluster"]["words"] = 2
  with pytest.raises(UsageError, match=r"trained with data.cluster.words=0 where the study now makes 2"):
    records.restore(str(kept), str(tmp_path / "new"), ["gate"], SPEC, {("gate", "narrow"): now})


# slow (about a minute): .ci/run goes on from a record alone at the quick size, end to end; this is every stage
@pytest.mark.slow
def test_the_study_goes_on_from_its_record_where_its_directory_was_lost(tmp_path, faked):  # noqa: F811
  """Every stage at the quick size, DIR lost after the gate and again at the end: the next part trains only what
  was not finished, and the report from the record alone is the report from the whole DIR."""
  trained, _, _ = faked
  kept = str(tmp_path / "records")
  capacity.run(str(tmp_path / "part1"), SPEC, True, 1, stages=["preflight", "gate"], kept=kept)
  gate_runs = list(trained)
  assert (tmp_path / "records" / "capacity.md").read_text().count("## Stage") == 3  # its search and runs
  whole = capacity.run(str(tmp_path / "part2"), SPEC, True, 1, kept=kept)
  assert trained[:len(gate_runs)] == gate_runs and not set(gate_runs) & set(trained[len(gate_runs):])
  count = len(trained)
  again = capacity.run(str(tmp_path / "part3"), SPEC, True, 1, kept=kept)
  assert len(trained) == count  # nothing trained twice, and no memory run evaluated again (evaluate_runs skips it):
  memory = [w for w in (tmp_path / "part3").glob("*/routed*")]
  assert len(memory) == 3 + 1 + 2 and all(evaluation.evaluated(str(w), True) for w in memory)
  assert again.split("## Wall time")[0] == whole.split("## Wall time")[0]
  assert (tmp_path / "records" / "capacity.md").read_text() == again


def test_a_recorded_run_whose_config_the_study_no_longer_makes_is_one_error(tmp_path):
  out, kept = tmp_path / "dir", tmp_path / "records"
  _run(str(out / "gate"), "narrow")
  records.save(str(out), str(kept), ["gate"], _done)
  assert records.restore(str(kept), str(tmp_path / "same"), ["gate"], SPEC, {("gate", "narrow"): {"name": "narrow"}})
  with pytest.raises(UsageError, match=r"its run gate/narrow was trained with name='narrow' where the study now makes "
                     r"'wider'; run the moc_jax and configs it was trained with"):
    records.restore(str(kept), str(tmp_path / "new"), ["gate"], SPEC, {("gate", "narrow"): {"name": "wider"}})
  assert not (tmp_path / "new").exists()


def test_a_sweep_cut_short_has_its_finished_memory_runs_evaluated_and_recorded(tmp_path, faked, monkeypatch):  # noqa: F811
  """A memory run of the `lr` sweep fails (as a run stopped by SIGTERM does not finish): the command stops, but the
  sweep's finished memory runs are evaluated with their memory knocked out and kept by the record, so a next part on
  another machine does not train them again."""
  from experiments.sweeps import launch
  from tests.experiments.test_capacity import _fake_training
  trained, evaluated, recalls = faked
  failing = "routed-prefix-attention-base_lr0.000556-memory_lr0.000556-steps4"  # the search's second round: recalls
  # alike, the lower rate is the best
  recall = lambda name: recalls.get(name, 0.95 if name.startswith("dense-num_entities") else 0.5)  # noqa: E731
  monkeypatch.setattr(launch.subprocess, "Popen", _fake_training(trained, recall, fails={failing}))
  kept = str(tmp_path / "records")
  with pytest.raises(SystemExit, match="lr finished 5 of 6 runs"):
    capacity.run(str(tmp_path / "dir"), SPEC, True, 1, stages=["preflight", "gate", "arms"], kept=kept)
  finished_memory = [n for n in trained if n.startswith("routed") and n != failing]
  assert evaluated == finished_memory and len(finished_memory) == 2
  lr = {n for n in trained if n.startswith(("routed", "dense-mlp"))}
  assert {e["name"] for e in read_manifest(os.path.join(kept, "lr"))} == lr - {failing}
