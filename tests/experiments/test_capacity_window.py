"""experiments/capacity_window.py: the gate's window against hand counts, and on the d 16 gate's own record."""
import gzip
import os
import shutil

import pytest

from experiments import capacity_window

RECORD = "docs/results/capacity-study-n16-e6144/gate/dense-cooldowns0.5-base_lr0.00111-memory_lr0.00111"


def test_the_window_by_hand():
  """Held 41.2 kbit, 6.5 of them won in the last doubling, 40 bits a entity: the plateau check needs a corpus of at
  least 0.75 * 6.5 / 0.02 = 243.75 kbit (6,093.75 entities), the floor at most 0.75 * 41.2 / 0.1 = 309 kbit (7,725)."""
  assert capacity_window.window(41.2, 6.5, 40) == pytest.approx((6093.75, 7725.0))
  # dH / H = 0.25 is over PLATEAU_RISE / PLATEAU_FLOOR = 0.2: a corpus small enough for the floor rises too much
  assert capacity_window.window(10.0, 2.5, 40) is None
  # nothing won: the plateau check holds on any corpus, the floor up to 0.75 * 10 / 0.1 = 75 kbit (1,875 entities)
  assert capacity_window.window(10.0, -1.0, 40) == pytest.approx((0.0, 1875.0))


def test_the_curve_reads_readings_from_updates_and_held_bits_from_recall():
  rows = [{"step": 100, "probe_acc": 0.55, "num_probes": 4096, "probe_exact": 0.2},
          {"step": 40, "cooldown_end": 50, "probe_acc": 0.4, "num_probes": 4096, "probe_exact": 0.1}]
  points = capacity_window.curve(rows, steps=100, readings=400, fact_bits=30_000)
  assert [(p["readings"], p["updates"]) for p in points] == [(200, 50), (400, 100)]
  # (0.4 - 0.25) / 0.75 = 0.2 and (0.55 - 0.25) / 0.75 = 0.4 of 30 kbit
  assert [p["held"] for p in points] == pytest.approx([6.0, 12.0])


def test_the_d16_gate_record_reads_as_its_hand_numbers(tmp_path, capsys):
  """The 6,144-entity gate: 1,474 then 1,556 of 4,096 probes (0.360, 0.380) of 264.0 kbit: 38.7 and 45.7 kbit held,
  +82 probes, dH / H = 82 / (1,556 - 1,024) = 0.154. In entities the window is the rise and the floor's margin scaled:
  from 82 / 4,096 / 0.02 * 6,144 = 6,150 to (1,556 / 4,096 - 0.25) / 0.1 * 6,144 = 7,980 entities. The gate's 6,144
  is just under it: it failed by a probe."""
  shutil.copy(os.path.join(RECORD, "config.json"), tmp_path)
  with gzip.open(os.path.join(RECORD, "metrics.jsonl.gz"), "rb") as f, open(tmp_path / "metrics.jsonl", "wb") as g:
    g.write(f.read())
  lines = capacity_window.main([f"--run={tmp_path}"])
  assert lines[2] == "| 200 | 38,400 | 0.360 ± 0.007 | 0.081 | 38.7 |  |  |  |"
  assert lines[3] == "| 400 | 76,800 | 0.380 ± 0.008 | 0.082 | 45.7 | +0.020, +82 | 0.154 | 6,150 to 7,980 (1.30x) |"
  assert capsys.readouterr().out.splitlines() == lines


def test_a_directory_without_a_run_is_one_error_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    capacity_window.main([f"--run={tmp_path}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: --run={tmp_path}: give a training run's directory (it holds config.json), e.g. "
      "--run=runs/plateau-n16-e6144/r1600"]
