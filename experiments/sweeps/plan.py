"""Planning a sweep: the named lists of config overrides defined beside the configs (`get_sweep(name, config)`
in configs/moc.py, big_vision's get_hyper), each point's run name, its config resolved and validated with
moc_jax.main's own parser (nothing compiled), its training compute, and whether two points are the same run.

Launching the points: experiments/sweeps/launch.py; what they reached: experiments/sweeps/report.py
(`python launch/sweep.py --help`, `python launch/collect.py`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re

from moc_jax.config import config_module, memory_layers, validate
from moc_jax.errors import ConfigError

BANK_KEYS = ("memory.num_tokens", "memory.num_chapters")
# Short run-name tags; any other field is named by its last component.
_TAGS = {"memory.top_k": "k", "memory.num_tokens": "bank", "model.mlp_dim": "mlp", "model.num_layers": "layers",
         "train.steps": "steps", "memory.load_balance": "", "memory.routing": "", "memory.routing_pool": "",
         "train.bank_lr": "banklr", "data.facts.seed": "corpus"}
# field -> the field it follows: chapters from the bank at a fixed chapter size, the decay start, warm-up,
# evaluations, checkpoints and curriculum from the steps, the placement from memory.enabled=False, the data order
# from the seed, the loss weight from the balance.
IMPLIED = {"memory.num_chapters": "memory.num_tokens", "train.decay_start_step": "train.steps",
            "train.warmup_steps": "train.steps", "train.eval_every": "train.steps",
            "train.checkpoint_every": "train.steps", "data.facts.warmup_docs": "train.steps",
            "data.facts.ramp_docs": "train.steps", "memory.placement": "memory.enabled", "data.seed": "seed",
            "memory.load_balance_coef": "memory.load_balance"}


@dataclasses.dataclass(eq=False)
class Point:
  """One run of a sweep: `overrides` as given to moc_jax.main, `config` what they resolve to."""
  name: str
  overrides: dict
  config: object


# ---- names and flags --------------------------------------------------------------------------------

def flag_value(value) -> str:
  """`value` as the text of `--config.x=` that ml_collections parses back to it (tuples as `(a, b)`)."""
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(map(flag_value, value)) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def config_flags(overrides: dict) -> list[str]:
  return [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()]


MAX_NAME = 120  # a run's directory name, well inside a file system's 255 bytes


def run_name(overrides: dict) -> str:
  """Deterministic from the overrides, in their order: `k8-bank1040`, `dense-mlp224`; `base` if none.
  `memory.enabled=False` is `dense`; a field that follows another overridden one (IMPLIED) is left out. A name
  longer than MAX_NAME keeps its head and its tail (where a sweep's knobs usually are) around a digest of the
  whole, so it stays unique."""
  name = _full_name(overrides)
  if len(name) <= MAX_NAME:
    return name
  digest = hashlib.sha256(name.encode()).hexdigest()[:8]
  return f"{name[:40]}-{digest}-{name[-(MAX_NAME - 50):]}"


def _full_name(overrides: dict) -> str:
  parts = []
  for key, value in overrides.items():
    if key == "memory.enabled" and value is False:
      parts.append("dense")
    elif IMPLIED.get(key) not in overrides:
      text = re.sub(r"[^A-Za-z0-9.]+", "_", flag_value(value)).strip("_")
      parts.append(_TAGS.get(key, key.rsplit(".", 1)[-1]) + text)
  return "-".join(parts) or "base"


def default_name(spec: str, sweep: str) -> str:
  """`configs/moc.py:tiny`, `demo` -> `moc-tiny-demo`."""
  path, _, arg = spec.partition(":")
  return "-".join(p for p in (os.path.splitext(os.path.basename(path))[0], arg.replace(",", "_"), sweep) if p)


# ---- planning ---------------------------------------------------------------------------------------

def resolve(spec: str, overrides: dict):
  """The config moc_jax.main builds from `--config=spec` and the overrides' flags, with the same parser."""
  from absl import flags
  from ml_collections import config_flags as cf
  argv = ["moc_jax.main", f"--config={spec}", *config_flags(overrides)]
  values = flags.FlagValues()
  cf.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
  try:
    values(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as e:  # an unknown field or a bad value
    raise ConfigError(f"{spec} with {' '.join(argv[2:])}: {e}") from e
  return values.config


def plan(spec: str, sweep: str, extra: dict | None = None, only=None, base: dict | None = None) -> list[Point]:
  """The sweep's points, each resolved and validated (nothing compiled). `extra` overrides (e.g. from
  the command line) change the config the sweep is built from and apply to every point without entering
  its name; a field the sweep sets itself is refused. `base` overrides are the same, except that a point
  that sets the field keeps its own value (a harness's size: the `budget` sweep scales the steps it is
  given). `only` keeps the named points."""
  path = spec.partition(":")[0]
  module = config_module(path)
  if not hasattr(module, "get_sweep"):
    raise ConfigError(f"{path} defines no sweeps (get_sweep); configs/moc.py does")
  extra, base, points, seen = dict(extra or {}), dict(base or {}), [], {}
  try:
    overrides_list = module.get_sweep(sweep, resolve(spec, {**base, **extra}))
  except ValueError as e:  # an unknown sweep
    raise ConfigError(str(e)) from e
  for overrides in overrides_list:
    name = run_name(overrides)
    if name in seen:
      if seen[name] != overrides:
        raise ConfigError(f"sweep {sweep}: points {seen[name]} and {overrides} are both named {name!r}")
      continue  # the same run twice (e.g. one vanilla baseline for two MoC points)
    seen[name] = overrides
    clash = sorted(set(extra) & set(overrides))
    if clash:
      raise ConfigError(f"--config.{clash[0]} is set by sweep {sweep} itself (point {name})")
    if only is None or name in only:
      kept = {k: v for k, v in base.items() if k not in overrides}
      points.append(Point(name, {**kept, **overrides, **extra}, None))
  unknown = sorted(set(only or ()) - set(seen))
  if unknown:
    raise ConfigError(f"--only: no points {unknown} in sweep {sweep}; it has {sorted(seen)}")
  for p in points:
    p.config = resolve(spec, p.overrides)
    try:
      validate(p.config)
    except ConfigError as e:
      raise ConfigError(f"sweep {sweep}, point {p.name}: {e}") from e
  return points


def compute(config) -> dict:
  """Tokens and training FLOPs of a run: the estimator's model FLOPs per token (forward + backward, memory
  counted as read, no recompute; the MFU count) times the tokens of train.steps updates."""
  from moc_jax.flops import model_flops_per_token
  t = config.train
  tokens = t.steps * t.batch_size * t.grad_accum * config.data.seq_len
  per_token = model_flops_per_token(config)
  return {"tokens": tokens, "flops_per_token": per_token, "train_flops": per_token * tokens}


def is_moc(config) -> bool:
  return bool(config.memory.enabled and memory_layers(config))


def same_run(a, b) -> bool:
  """Whether two resolved configs train the same run, so that one's finished workdir stands for the other's.
  They must be equal but for two things no step reads: when they evaluate, while both evaluate only at step 0
  and at their end (train.eval_every ≥ train.steps), and, in a model without memory layers, the memory fields
  beyond memory.enabled and memory.placement. The same config and seed then give the same losses and the same
  final evaluation (tests/sweeps/test_same_run.py trains both sides)."""
  def key(config):
    c = config.to_dict()
    if c["train"]["eval_every"] >= c["train"]["steps"]:
      c["train"]["eval_every"] = "end"
    if not memory_layers(config):
      c["memory"] = {k: c["memory"][k] for k in ("enabled", "placement")}
    return c
  return key(a) == key(b)
