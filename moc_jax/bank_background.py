"""Background counts of chapter reads: how often pre-training data reads each chapter, the document frequency
that sparse memory finetuning (`train.bank_optimizer=smf`) ranks a new batch's reads against.

`python -m moc_jax.eval.background --workdir=RUN` writes RUN/bank_background.json: per bank and chapter, the
routing decisions over the first batches of the training split that selected the chapter (`df`), and the
decisions made (`decisions`, per bank: every decision of every memory layer reading it). A decision is one
routed choice of top-k chapters: per row under sequence routing, per position under segment / prefix / token
routing, per chunk under chunk routing. The shared chapters are read by every decision (df = decisions).

    idf[b, c] = log((1 + decisions[b]) / (1 + df[b, c]))

is 0 for a chapter every decision reads (the shared chapters) and largest for a chapter pre-training never
read. A JSON file, not a checkpoint: a few integers per chapter, read by people as much as by programs.
"""
from __future__ import annotations

import json
import os

import numpy as np

from moc_jax.errors import ConfigError

FILENAME = "bank_background.json"


def path_for(train_config) -> str:
  """Where an smf run reads its background: train.smf_background, else <train.init_from>/bank_background.json."""
  return train_config.smf_background or os.path.join(train_config.init_from, FILENAME)


def per_bank(counts, decisions, banks_of_layer, num_shared) -> dict:
  """counts [memory layers, C] (routed selections of each layer over `decisions` decisions each) -> df
  [banks, C] (the layers reading a bank summed; the shared chapters: every decision) and decisions [banks]."""
  banks = np.asarray(banks_of_layer)
  num_banks = banks.max() + 1
  df = np.zeros((num_banks, np.shape(counts)[1]), np.int64)
  np.add.at(df, banks, np.asarray(counts, np.int64))
  total = decisions * np.bincount(banks, minlength=num_banks)  # each layer reading bank b decides
  df[:, :num_shared] = total[:, None]
  return {"df": df, "decisions": total}


def write(path: str, df: np.ndarray, decisions: np.ndarray, **meta) -> None:
  """df [banks, chapters] and decisions [banks] (integers) with `meta` (step, split, batches), written whole or
  not at all (a temporary file renamed into place)."""
  record = {**meta, "decisions": [int(d) for d in decisions], "df": np.asarray(df, np.int64).tolist()}
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, path)


def idf(path: str, banks: int, chapters: int) -> np.ndarray:
  """float32 [banks, chapters] from the file at `path`, refused with the field and the fix when it is missing
  or was counted for another bank."""
  fix = ("run `python -m moc_jax.eval.background --workdir=<pre-training run>` and point "
         "train.smf_background (or train.init_from) at that run")
  if not os.path.isfile(path):
    raise ConfigError(f"train.smf_background: {path} does not exist; {fix}")
  try:
    with open(path) as f:
      record = json.load(f)
    df = np.asarray(record["df"], np.float64)
    decisions = np.asarray(record["decisions"], np.float64)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"train.smf_background: {path} is not a background file ({e}); {fix}") from None
  if df.shape != (banks, chapters) or decisions.shape != (banks,):
    raise ConfigError(f"train.smf_background: {path} counts {df.shape[0] if df.ndim == 2 else '?'} banks x "
                      f"{df.shape[-1]} chapters, the model has {banks} x {chapters}; {fix}")
  if np.any(df < 0) or np.any(df > decisions[:, None]):
    raise ConfigError(f"train.smf_background: {path} has counts outside [0, decisions]; {fix}")
  return np.log((1.0 + decisions[:, None]) / (1.0 + df)).astype(np.float32)
