"""Parity with MoC-PT on the fixture it produced (weights, logits, both losses, every gradient)."""
import os
import subprocess
import sys

from moc_jax import parity

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "moc_pt_paper_small.npz")


def test_fixture_parity_all_quantities():
  errors = parity.compare(FIXTURE)
  assert len([k for k in errors if k.startswith("grad/")]) == 53
  worst = max(errors, key=errors.get)
  assert errors[worst] <= parity.TOLERANCE, (worst, errors[worst])


def test_parity_cli_exit_code():
  out = subprocess.run([sys.executable, "-m", "moc_jax.parity", FIXTURE], capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "PASS" in out.stdout
