"""The language-model losses (float32), shared by training, evaluation and the parity check."""
from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE = -100


def next_token_nll_rows(logits, labels):
  """Per row (sum of next-token NLL, number of scored tokens): logits[:, :-1] predict labels[:, 1:]."""
  logits = logits[:, :-1].astype(jnp.float32)
  targets = labels[:, 1:]
  valid = targets != IGNORE
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(valid, lse - picked, 0.0), axis=-1), jnp.sum(valid, axis=-1)


def next_token_nll(logits, labels):
  """(sum of next-token NLL, number of scored tokens) over the batch."""
  nll, count = next_token_nll_rows(logits, labels)
  return jnp.sum(nll), jnp.sum(count)


def next_token_ce(logits, labels):
  """Mean next-token cross-entropy over non-ignored labels (MoC-PT's per-micro-batch token mean)."""
  total, count = next_token_nll(logits, labels)
  return total / jnp.maximum(count, 1)


def forward(model, batch, *, train):
  """The model on a data batch dict (optional keys: attention_mask, segment_ids, positions)."""
  return model(batch["input_ids"], batch.get("attention_mask"), segment_ids=batch.get("segment_ids"),
               positions=batch.get("positions"), train=train)


def lm_loss(model, batch, *, train):
  """CE (+ router aux loss when training, as MoC-PT adds it only in train mode) -> (loss, (ce, aux))."""
  logits, aux = forward(model, batch, train=train)
  ce = next_token_ce(logits, batch["labels"])
  loss = ce + aux["router_loss"] if train else ce
  return loss, (ce, aux)
