"""How far a run's bank moves in training: per saved checkpoint, the RMS of the bank's values and the mean
cosine of each bank token to its initial draw and to the previous checkpoint's.

The memory layers RMS-normalise every bank token before they read it (`memory.token_norm`), so a token's
direction is all that counts: a mean cosine near 1 says the bank is still about its random draw, whatever
its learning rate; the RMS says how far an Adam step of that LR turns it (a step of a given size turns a
short token further). docs/routing.md#how-fast-the-bank-learns-bank_lr reads the `bank_lr` sweep with it.

  python -m moc_jax.eval.bank_motion WORKDIR [WORKDIR ...]

One line per workdir and saved step, and with --json one JSON object per line. The initial draw is the
config's (config.json's `seed`); a run started from other weights (`train.init_from`) did not start there.
Only the workdirs are read.
"""
import argparse
import json
import sys

import numpy as np
from flax import nnx

from moc_jax import cli, sharding
from moc_jax.checkpoint import saved_steps, checkpoint_dir
from moc_jax.config import bank_shape
from moc_jax.errors import ConfigError
from moc_jax.state import build_state, restore_params


def bank_of(params, num_chapters) -> np.ndarray:
  """The bank values of a params state as float64 [banks, chapters, tokens, dim], without the chapters a
  sharded layout pads it with."""
  banks = [np.asarray(v[...], np.float64) for path, v in nnx.to_flat_state(params) if "bank" in path]
  if not banks:
    raise ConfigError("the run has no memory bank (memory.enabled=False): give a MoC run's workdir")
  return banks[0][:, :num_chapters]


def mean_cosine(a, b) -> float:
  """Mean over tokens (rows of the last axis) of cos(a, b); tokens that are zero in either are left out."""
  na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
  keep = (na > 0) & (nb > 0)
  return float(np.mean(np.sum(a * b, -1)[keep] / (na * nb)[keep]))


def motion(workdir: str) -> list[dict]:
  """Per saved step: {step, rms, cos_init, cos_previous} (cos_previous against the previous saved step;
  None for the first)."""
  config = cli.run_config(workdir, {})
  mesh = sharding.make_mesh(config)
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = build_state(config, mesh)
    chapters = bank_shape(config).rows  # chapters, or a pkm / hml table's slots
    init = bank_of(layout.init()["params"], chapters)
    rows, previous = [], None
    for step in saved_steps(checkpoint_dir(workdir)):
      bank = bank_of(restore_params(workdir, layout, step)[0], chapters)
      rows.append({"step": step, "rms": float(np.sqrt(np.mean(np.square(bank)))),
                   "cos_init": mean_cosine(bank, init),
                   "cos_previous": None if previous is None else mean_cosine(bank, previous)})
      previous = bank
  return rows


@cli.exit_on_error
def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--json", action="store_true", help="one JSON object per line")
  args = parser.parse_args(argv)
  for workdir in args.workdirs:
    for row in motion(workdir):
      if args.json:
        print(json.dumps({"workdir": workdir, **row}))
      else:
        prev = "" if row["cos_previous"] is None else f"  cos to previous {row['cos_previous']:.3f}"
        print(f"{workdir}  step {row['step']}: rms {row['rms']:.4f}  cos to init {row['cos_init']:.3f}{prev}")


if __name__ == "__main__":
  sys.exit(main())
