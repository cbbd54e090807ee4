"""Vanilla (memory-free) baselines: `--config=configs/vanilla.py:NAME[,runlocal]`.

`backbone` is the MoC model with the memory removed (16 layers for the paper model); `tiny`/`small`
mirror moc.py. `iso` is the paper's "iso-FLOP" baseline as trained (24 layers, MoC-PT vanilla_control_run5),
which by MoC-PT's own estimator (moc_jax/flops.py) is not iso-FLOP: +8.0% forward and forward+backward,
+8.3% training with layer recompute, against the MoC 262k model (docs/mocpt_semantics.md#iso-flop-baseline).
`iso=<moc name>` (e.g. `iso=262k`, `iso=small`) instead picks the depth whose training FLOPs (recompute
included, one data.seq_len sequence) are closest to that MoC model's, and prints it: 22 layers for 262k
(+0.4%).
"""
from moc_jax.config import schema, sibling

moc = sibling(__file__, "moc")

_LAYERS = {"backbone": None, "iso": 24, "tiny": None, "small": None}
_ISO_TARGETS = {f"iso={name}": name for name in moc.MODELS}


def _without_memory(c, name):
  c.name = f"vanilla-{name}"
  c.memory.enabled = False
  c.memory.placement = "none"
  return c


def _iso_flop_layers(target):
  """Depth of the vanilla model whose training FLOPs per sequence are closest to MoC `target`'s."""
  from moc_jax.flops import estimate

  moc_config = moc.get_config(target)
  goal = estimate(moc_config)["train"]["micro_step"]
  vanilla = _without_memory(moc.get_config(target), f"iso-{target}")

  def cost(layers):
    vanilla.model.num_layers = layers
    return estimate(vanilla)["train"]["micro_step"]

  layers = 1
  while cost(layers + 1) <= goal:  # training FLOPs grow with depth
    layers += 1
  layers = min((layers, layers + 1), key=lambda n: abs(cost(n) - goal))
  print(f"configs/vanilla.py:iso={target}: {layers} layers, training FLOPs {cost(layers) / goal - 1:+.2%} vs "
        f"moc {target} ({cost(layers):,} vs {goal:,} per {moc_config.data.seq_len}-token sequence)")
  return layers


def get_config(arg="tiny"):
  name, mods = schema.parse_arg(arg, {*_LAYERS, *_ISO_TARGETS})
  if name in _ISO_TARGETS:
    base, layers = _ISO_TARGETS[name], _iso_flop_layers(_ISO_TARGETS[name])  # chosen before modifiers
  else:
    base, layers = ("262k" if name in ("backbone", "iso") else name), _LAYERS[name]
  c = _without_memory(moc.get_config(",".join([base, *sorted(mods)])), name.replace("=", "-"))
  if layers:
    c.model.num_layers = layers
  return c
