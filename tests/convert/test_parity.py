"""Parity with MoC-PT on fixtures it produced (weights, logits, both losses, every gradient): sequence
routing (the paper's mode) and token routing (right-padded rows)."""
import os
import subprocess
import sys

import pytest

from moc_jax import parity

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
NAMES = ("moc_pt_paper_small.npz", "moc_pt_token_small.npz")


@pytest.mark.parametrize("name", NAMES)
def test_fixture_parity_all_quantities(name):
  errors = parity.compare(os.path.join(FIXTURES, name))
  assert len([k for k in errors if k.startswith("grad/")]) == 53
  worst = max(errors, key=errors.get)
  assert errors[worst] <= parity.TOLERANCE, (worst, errors[worst])


@pytest.mark.slow  # the comparison itself runs in test_fixture_parity_all_quantities
def test_parity_cli_exit_code():
  out = subprocess.run([sys.executable, "-m", "moc_jax.parity", os.path.join(FIXTURES, NAMES[1])],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "PASS" in out.stdout
