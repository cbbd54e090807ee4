"""The language-model losses (float32), shared by training, evaluation and the parity check."""
from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE = -100


def next_token_nll_rows(logits, labels):
  """Per row (sum of next-token NLL, number of scored tokens): logits[:, :-1] predict labels[:, 1:]."""
  return _nll_rows(logits[:, :-1], labels[:, 1:])


def _nll_rows(logits, targets):
  """Per row (sum of NLL, count) of logits[:, p] scoring targets[:, p] (IGNORE skipped)."""
  logits = logits.astype(jnp.float32)
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


def _inputs(batch):
  return (batch["input_ids"], batch.get("attention_mask")), {
      "segment_ids": batch.get("segment_ids"), "positions": batch.get("positions"),
      "cluster_path": batch.get("cluster_path")}


def forward(model, batch, *, train, **extra):
  """The model on a data batch dict (optional keys: attention_mask, segment_ids, positions, cluster_path)."""
  args, kwargs = _inputs(batch)
  return model(*args, **kwargs, train=train, **extra)


def chunked_next_token_nll(model, h, labels, chunk):
  """next_token_nll without [B, L, V] logits: the head runs on `chunk` positions at a time under a
  scan, rematerialised in the backward pass, so only one chunk's logits are ever live."""
  b, l = labels.shape
  targets = jnp.concatenate([labels[:, 1:], jnp.full((b, 1), IGNORE, labels.dtype)], axis=1)
  n = l // chunk
  hs = jnp.moveaxis(h.reshape(b, n, chunk, h.shape[-1]), 1, 0)
  ts = jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0)

  @jax.checkpoint
  def part(h_c, t_c):  # position p scores targets[p] = labels[p + 1]
    nll, count = _nll_rows(model.logits(h_c), t_c)
    return jnp.sum(nll), jnp.sum(count)

  def body(acc, xs):
    nll, count = part(*xs)
    return (acc[0] + nll, acc[1] + count), None

  (total, count), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)), (hs, ts))
  return total, count


def lm_loss(model, batch, *, train, bank_deltas=None):
  """CE (+ router aux loss when training, as MoC-PT adds it only in train mode) -> (loss, (ce, aux)).
  With `model.logits_chunk` the head runs chunk by chunk (same value, far smaller temporaries).
  `bank_deltas`: the memory layers read the bank through them (Transformer.__call__)."""
  chunk = model.cfg.model.logits_chunk
  extra = {} if bank_deltas is None else {"bank_deltas": bank_deltas}
  if chunk and batch["labels"].shape[1] % chunk == 0 and batch["labels"].shape[1] > chunk:
    args, kwargs = _inputs(batch)
    h, aux = model.features(*args, **kwargs, train=train, **extra)
    total, count = chunked_next_token_nll(model, h, batch["labels"], chunk)
    ce = total / jnp.maximum(count, 1)
  else:
    logits, aux = forward(model, batch, train=train, **extra)
    ce = next_token_ce(logits, batch["labels"])
  loss = ce + aux["router_loss"] if train else ce
  return loss, (ce, aux)
