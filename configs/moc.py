"""Mixture-of-Chapters models: `--config=configs/moc.py:NAME[,runlocal]`.

NAME: `262k` (the paper model, MoC-PT base_small_run2 / run5), `small` and `tiny` (CPU work).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (configs are loaded by path, not as a package)


def _262k(c):
  # As trained (MoC-PT run5): one document per 1024-token row, 1024 rows per update, WSD 250 / 8160 / 9600.
  c.data.update(seq_len=1024, layout="pad_truncate")
  c.train.update(batch_size=256, grad_accum=4, steps=9600, warmup_steps=250, decay_start_step=8160)
  return c


def _small(c):
  c.model.update(vocab_size=512, d_model=256, num_layers=8, num_heads=8, num_kv_heads=4,
                 mlp_dim=768, max_seq_len=256)
  c.memory.update(num_tokens=257 * 32, num_chapters=257, num_shared=1, top_k=16,
                  num_heads=8, num_kv_heads=8, layer_indices=(1, 3, 5, 7))
  c.data.seq_len = 256
  return c


def _tiny(c):
  c.model.update(vocab_size=260, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 mlp_dim=192, max_seq_len=128)
  c.memory.update(num_tokens=65 * 16, num_chapters=65, num_shared=1, top_k=8,
                  num_heads=4, num_kv_heads=4, layer_indices=(1, 3))
  c.data.seq_len = 128
  # `make run`: the embedded facts corpus, sized so recall is measurable within minutes on 2 CPU cores.
  c.data.facts.update(num_entities=64, num_docs=8000, num_val_docs=400)
  c.train.update(batch_size=32, steps=900, warmup_steps=30, decay_start_ratio=0.8, base_lr=3e-3,
                 memory_lr=3e-3, log_every=25, eval_every=150, eval_batches=8, checkpoint_every=300)
  return c


MODELS = {"262k": _262k, "small": _small, "tiny": _tiny}


def get_config(arg="tiny"):
  name, mods = common.parse_arg(arg, MODELS)
  c = MODELS[name](common.base_config())
  c.name = f"moc-{name}"
  if "runlocal" in mods:
    c = common.runlocal(c)
  unknown = mods - {"runlocal"}
  if unknown:
    raise ValueError(f"config arg {arg!r}: unknown modifiers {sorted(unknown)}; known: ['runlocal']")
  return c
