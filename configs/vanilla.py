"""Vanilla (memory-free) baselines: `--config=configs/vanilla.py:NAME[,runlocal]`.

`backbone` is the MoC model with the memory removed (16 layers for the paper model); `iso` is the
paper's iso-FLOP baseline (24 layers, MoC-PT vanilla_control_run5); `tiny`/`small` mirror moc.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import moc  # noqa: E402

_LAYERS = {"backbone": None, "iso": 24, "tiny": None, "small": None}


def get_config(arg="tiny"):
  name, mods = common.parse_arg(arg, _LAYERS)
  base = "262k" if name in ("backbone", "iso") else name
  c = moc.get_config(",".join([base, *sorted(mods)]))
  c.name = f"vanilla-{name}"
  c.memory.enabled = False
  c.memory.placement = "none"
  if _LAYERS[name]:
    c.model.num_layers = _LAYERS[name]
  return c
