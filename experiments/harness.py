"""What the study harnesses (experiments.retention, experiments.routing_evidence) share on their command line:
their directory, the config whose sweeps define their runs, their quick size and how many runs at once. The
library's own commands take none of these: moc_jax/cli.py knows no harness.
"""
from __future__ import annotations

from absl import flags

from moc_jax.errors import UsageError


def define_flags(out, layout, sweeps_help):
  """A harness's flags: its directory (default `out`, holding `layout`), the config file whose sweeps define
  its runs, its quick size, and the runs at once."""
  flags.DEFINE_string("out", out, f"Directory of the harness ({layout}).")
  flags.DEFINE_string("config", "configs/moc.py:tiny", f"The config file and argument whose sweeps {sweeps_help}.")
  flags.DEFINE_bool("quick", False, "The smallest size (one seed, a few steps, tiny shapes): a test of the harness.")
  flags.DEFINE_integer("parallel", 2, "Runs (and evaluations) at once; at least 1.")


def check_parallel(parallel):
  """A harness's --parallel, refused with one line (exit 2) when below 1."""
  if parallel < 1:
    raise UsageError(f"--parallel={parallel}: run at least one at a time")
