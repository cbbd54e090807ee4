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
  batch = {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask > 0, ids, -100)}
  if config.data.cluster.k:  # each row one document down a random path of the tree (node ids per level), -1 on pads
    k, paths = config.data.cluster.k, np.zeros((rows, config.data.cluster.levels), np.int32)
    for level in range(config.data.cluster.levels):
      paths[:, level] = (paths[:, level - 1] * k if level else 0) + rng.integers(0, k, rows)
    batch["cluster_path"] = np.where(mask[..., None] > 0, paths[:, None, :], -1).astype(np.int32)
  return batch
