"""A tiny, fast training setup shared by the training tests (small facts corpus, 32-token rows)."""
import json
import os

import numpy as np

TINY_OVERRIDES = {
    "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 4, "train.steps": 2,
    "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 2, "train.eval_batches": 2,
    "train.checkpoint_every": 2, "train.num_probes": 8, "train.progress": "log",
    "data.facts.num_entities": 40, "data.facts.num_docs": 200, "data.facts.num_val_docs": 20,
}


def overrides(data_dir, **extra):
  return {**TINY_OVERRIDES, "data.data_dir": str(data_dir), **extra}


def cli_args(config, data_dir, workdir, **extra):
  args = [f"--config={config}", f"--workdir={workdir}"]
  args += [f"--config.{k}={v}" for k, v in overrides(data_dir, **extra).items()]
  return args


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(workdir):
  return {r["step"]: (r["loss"], r["ce"], r["aux"], r["grad_norm"]) for r in read_metrics(workdir) if "split" not in r}


def random_batch(config, seed):
  """One update's rows (grad_accum micro-batches): seeded random tokens, every third row right-padded by 5."""
  rng = np.random.default_rng(seed)
  rows = config.train.batch_size * config.train.grad_accum
  ids = rng.integers(0, config.model.vocab_size, (rows, config.data.seq_len), np.int32)
  mask = np.ones_like(ids)
  mask[::3, -5:] = 0
  return {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask > 0, ids, -100)}
