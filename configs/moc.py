"""Mixture-of-Chapters models: `--config=configs/moc.py:NAME[,runlocal]`.

NAME: `262k` (the paper model, MoC-PT base_small_run2 / run5), `small` and `tiny` (CPU work).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (configs are loaded by path, not as a package)


def _262k(c):
  c.data.seq_len = 1024  # the paper model as trained: 1024-token rows
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
