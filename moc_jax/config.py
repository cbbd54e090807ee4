"""Config loading, validation and the facts derived from a config (memory layers, banks, scan plan).

`validate()` is the single gate: every inconsistent field is rejected here, with one message naming
the field and the fix, before any array is allocated. Model code reads fields, never re-checks them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

from ml_collections import config_dict

PLACEMENTS = ("all", "first_k", "last_k", "every_n", "custom", "none")
SHARINGS = ("shared", "per_layer", "every_k_layers")
VARIANTS = ("A", "B")
TOKEN_NORMS = ("rms", "layernorm", "none")
ROUTINGS = ("sequence", "token", "prefix", "chunk")
DECODE_ROUTINGS = ("auto", "sequence", "rolling", "hybrid", "token", "prefix", "chunk")
ATTENTION_IMPLS = ("auto", "pallas", "xla", "reference")
DTYPES = ("float32", "bfloat16", "float16")
REMATS = ("none", "full", "dots")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def routing_is_causal(c) -> bool:
  """Whether each position's output depends only on tokens at or before it (the backbone always is;
  `sequence` routing pools the whole row, the other modes pool the past)."""
  return not (c.memory.enabled and memory_layers(c) and c.memory.routing == "sequence")


def routing_statement(c) -> str:
  """One line for the training log: the routing mode and whether the run is causal."""
  if not (c.memory.enabled and memory_layers(c)):
    return "no memory layers: causal"
  if routing_is_causal(c):
    return f"memory.routing={c.memory.routing}: causal (no position reads chapters chosen from later tokens)"
  return ("memory.routing=sequence: NOT causal (each row's chapters are chosen from all its tokens, "
          "future ones included; MoC-PT's paper mode)")


class ConfigError(ValueError):
  """A config field is inconsistent; the message names the field and the fix."""


def parse_flags(argv):
  """absl's flag parser for `app.run(..., flags_parser=parse_flags)`: a bad flag, or a `--config.` override
  naming no field (ml_collections raises AttributeError / KeyError while parsing), is one `error:` line and
  exit 2, not a traceback."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # what absl's own parser reports, as one line
    _exit_bad_flag(f"{e} (--helpfull lists the flags)")
  except (AttributeError, KeyError) as e:
    _exit_no_field(e, argv)


def define_overrides_flag(default, help_text):
  """`--config.a.b=v` overrides of `default` (a run's saved config): ml_collections' DEFINE_config_dict, which
  parses sys.argv's overrides at once, a field it lacks reported as `parse_flags` does."""
  import sys
  from ml_collections import config_flags
  try:
    config_flags.DEFINE_config_dict("config", default, help_text, lock_config=False)
  except (AttributeError, KeyError) as e:
    _exit_no_field(e, sys.argv)


def _exit_no_field(e, argv):
  import re
  detail = " ".join(re.sub(r"\\[n']|[\n'\"]", " ", str(e.args[0] if e.args else e)).split())
  overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
  _exit_bad_flag(f"a --config override names no config field ({detail}); overrides given: {', '.join(overrides)}")


def _exit_bad_flag(message):
  import sys
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def config_module(path: str):
  """The config file at `path` (relative to the working directory or the repository) as a module: configs
  are loaded by path, not imported as a package."""
  if not os.path.isabs(path) and not os.path.exists(path):
    path = os.path.join(REPO_ROOT, path)
  if not os.path.exists(path):
    raise ConfigError(f"config file {path!r} not found; pass e.g. 'configs/moc.py:tiny'")
  module_spec = importlib.util.spec_from_file_location(f"_moc_cfg_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_config(spec: str, overrides: dict | None = None) -> config_dict.ConfigDict:
  """Loads `path.py[:arg]`, applies dotted `overrides`, validates, and returns a locked config."""
  path, _, arg = spec.partition(":")
  module = config_module(path)
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except ValueError as e:
    raise ConfigError(str(e)) from e
  for key, value in (overrides or {}).items():
    _set_dotted(config, key, value)
  validate(config)
  config.lock()
  return config


def _set_dotted(config, key, value):
  parent = config
  parts = key.split(".")
  for part in parts[:-1]:
    if not isinstance(parent, config_dict.ConfigDict) or part not in parent:
      raise ConfigError(f"override {key!r}: no field {part!r} in the config")
    parent = parent[part]
  if not isinstance(parent, config_dict.ConfigDict) or parts[-1] not in parent:
    known = sorted(parent.keys()) if isinstance(parent, config_dict.ConfigDict) else []
    raise ConfigError(f"override {key!r}: no field {parts[-1]!r}; known: {known}")
  try:
    parent[parts[-1]] = tuple(value) if isinstance(value, list) else value
  except TypeError as e:
    raise ConfigError(f"override {key!r}: {e}") from e


def _fail(field, problem, fix):
  raise ConfigError(f"config.{field}: {problem} — {fix}")


def _enum(c, field, allowed):
  node, name = field.split(".")
  value = c[node][name]
  if value not in allowed:
    _fail(field, f"unknown value {value!r}", f"use one of {list(allowed)}")


def _positive(c, field, allow_zero=False):
  node, name = field.split(".")
  value = c[node][name]
  if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
    _fail(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}", "set a valid value")


def validate(c) -> None:
  """Rejects an inconsistent config with one ConfigError naming the field and the fix."""
  m, mem = c.model, c.memory
  for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
            "max_seq_len", "rope_theta", "norm_eps", "init_std", "attn_out_init_std", "mlp_out_init_std"):
    _positive(c, f"model.{f}")
  for f in ("compute_dtype", "param_dtype"):
    _enum(c, f"model.{f}", DTYPES)
  _enum(c, "model.remat", REMATS)
  _positive(c, "model.logits_chunk", allow_zero=True)
  if m.d_model % m.num_heads:
    _fail("model.num_heads", f"{m.num_heads} does not divide d_model {m.d_model}", "pick a divisor of d_model")
  if m.num_heads % m.num_kv_heads:
    _fail("model.num_kv_heads", f"{m.num_kv_heads} does not divide num_heads {m.num_heads}",
          "pick a divisor of num_heads (GQA groups)")
  if (m.d_model // m.num_heads) % 2:
    _fail("model.num_heads", f"head_dim {m.d_model // m.num_heads} is odd", "RoPE needs an even head_dim")
  if "data" in c and c.data.seq_len > m.max_seq_len:
    _fail("data.seq_len", f"{c.data.seq_len} > model.max_seq_len {m.max_seq_len}", "shorten data.seq_len")
  if "train" in c:
    _validate_train(c)
  if mem.enabled:
    _validate_memory(c)
  if "mesh" in c:
    _validate_mesh(c)


def _validate_memory(c):
  m, mem = c.model, c.memory
  _enum(c, "memory.placement", PLACEMENTS)
  _enum(c, "memory.sharing", SHARINGS)
  _enum(c, "memory.block_variant", VARIANTS)
  _enum(c, "memory.token_norm", TOKEN_NORMS)
  _enum(c, "memory.routing", ROUTINGS)
  _enum(c, "memory.decode_routing", DECODE_ROUTINGS)
  _enum(c, "memory.sharded_read", ("auto", "ring", "scatter"))
  _enum(c, "memory.attention_impl", ATTENTION_IMPLS)
  for f in ("num_tokens", "num_chapters", "top_k", "num_heads", "num_kv_heads", "init_std",
            "placement_k", "placement_n", "sharing_k", "token_norm_eps", "routing_chunk", "routing_window"):
    _positive(c, f"memory.{f}")
  for f in ("num_shared", "routed_scaling_factor", "load_balance_coef", "z_loss_coef", "mse_aux_coef"):
    _positive(c, f"memory.{f}", allow_zero=True)
  if mem.dim is not None and mem.dim <= 0:
    _fail("memory.dim", f"must be > 0 or None, got {mem.dim}", "leave it None to use d_model")
  if mem.num_tokens % mem.num_chapters:
    _fail("memory.num_tokens", f"{mem.num_tokens} is not divisible by num_chapters {mem.num_chapters}",
          f"use a multiple of num_chapters, e.g. {mem.num_chapters * max(1, mem.num_tokens // mem.num_chapters)}")
  if mem.num_shared >= mem.num_chapters:
    _fail("memory.num_shared", f"{mem.num_shared} leaves no routable chapter of {mem.num_chapters}",
          "use fewer shared chapters than num_chapters")
  if mem.num_shared == 0 and mem.routed_scaling_factor == 0:
    _fail("memory.routed_scaling_factor", "0 with no shared chapter gives every chapter weight 0/0",
          "use a positive factor or add a shared chapter")
  if mem.top_k > mem.num_chapters - mem.num_shared:
    _fail("memory.top_k", f"{mem.top_k} > routable chapters {mem.num_chapters - mem.num_shared}",
          "lower top_k or add chapters")
  if m.d_model % mem.num_heads:
    _fail("memory.num_heads", f"{mem.num_heads} does not divide d_model {m.d_model}", "pick a divisor of d_model")
  if mem.num_heads % mem.num_kv_heads:
    _fail("memory.num_kv_heads", f"{mem.num_kv_heads} does not divide memory.num_heads {mem.num_heads}",
          "pick a divisor of memory.num_heads")
  if mem.placement == "custom":
    bad = [i for i in mem.layer_indices if not 0 <= i < m.num_layers]
    if bad or len(set(mem.layer_indices)) != len(mem.layer_indices):
      _fail("memory.layer_indices", f"{tuple(mem.layer_indices)} has out-of-range or repeated layers {bad}",
            f"use distinct indices in [0, {m.num_layers})")
  if mem.placement in ("first_k", "last_k") and mem.placement_k > m.num_layers:
    _fail("memory.placement_k", f"{mem.placement_k} > num_layers {m.num_layers}", "use at most num_layers")
  if not memory_layers(c):
    _fail("memory.placement", f"{mem.placement!r} places no memory layer",
          "set memory.enabled=False for a vanilla model, or place at least one memory layer")


SCHEDULES = ("wsd", "cosine", "linear", "constant")


def _validate_train(c):
  t = c.train
  for f in ("batch_size", "grad_accum", "steps", "log_every", "eval_every", "checkpoint_every",
            "keep_checkpoints", "max_nonfinite"):
    _positive(c, f"train.{f}")
  for f in ("base_lr", "memory_lr", "weight_decay", "clip_norm", "warmup_steps", "min_lr_ratio", "num_probes"):
    _positive(c, f"train.{f}", allow_zero=True)
  if t.bank_lr is not None and t.bank_lr < 0:
    _fail("train.bank_lr", f"must be >= 0 or None, got {t.bank_lr}", "use 0 for a frozen bank, None for memory_lr")
  _enum(c, "train.schedule", SCHEDULES)
  if t.warmup_steps > t.steps:
    _fail("train.warmup_steps", f"{t.warmup_steps} > train.steps {t.steps}", "shorten the warm-up")
  if t.schedule == "wsd" and t.decay_start_step is not None and t.decay_start_step > t.steps:
    _fail("train.decay_start_step", f"{t.decay_start_step} > train.steps {t.steps}: the learning rate would never "
          "decay", "set it <= train.steps (shortening a run: scale both), or use train.decay_start_ratio")
  if t.decay_start_ratio is not None and not 0 <= t.decay_start_ratio <= 1:
    _fail("train.decay_start_ratio", f"{t.decay_start_ratio} is outside [0, 1]", "use a fraction of train.steps")
  for f in ("b1", "b2"):
    if not 0 <= t[f] < 1:
      _fail(f"train.{f}", f"Adam beta must be in [0, 1), got {t[f]}", "e.g. 0.9 / 0.95")
  _positive(c, "train.eps")
  import jax
  if (t.batch_size * t.grad_accum) % jax.process_count():
    _fail("train.batch_size", f"{t.batch_size}*{t.grad_accum} is not divisible by {jax.process_count()} processes",
          "use a global batch divisible by the process count")


def _logical_dims(c) -> dict[str, list[tuple[str, int]]]:
  """(field, size) of every dimension each logical axis names, for the mesh divisibility check."""
  m, mem = c.model, c.memory
  dims = {"vocab": [("model.vocab_size", m.vocab_size)], "embed": [("model.d_model", m.d_model)],
          "heads": [("model.num_heads", m.num_heads)], "kv": [("model.num_kv_heads", m.num_kv_heads)],
          "mlp": [("model.mlp_dim", m.mlp_dim)], "layers": [("model.num_layers", layer_plan(c).num_groups)]}
  if "train" in c:
    dims["batch"] = [("train.batch_size", c.train.batch_size)]
  if mem.enabled and memory_layers(c):
    dims["embed"].append(("memory.dim", mem.dim or m.d_model))
    dims["heads"].append(("memory.num_heads", mem.num_heads))
    dims["kv"].append(("memory.num_kv_heads", mem.num_kv_heads))
    dims["chapter_tokens"] = [("memory.num_tokens", mem.num_tokens // mem.num_chapters)]
    dims["bank_embed"] = [("memory.dim", mem.dim or m.d_model)]
    dims["chapter_logits"] = [("memory.num_chapters", mem.num_chapters)]
    dims["banks"] = [("memory.sharing", max(bank_ids(c)) + 1)]
  return dims


def _validate_mesh(c):
  """The mesh must fit the devices, and every sharded dimension must divide by its shard count
  (except chapters, which are padded)."""
  from moc_jax import sharding
  sizes = sharding.mesh_shape(c, sharding.num_devices(c))
  rules = sharding.rules_of(c)
  for name, _ in rules:
    unknown = [a for a in sharding.mesh_axes_of(rules, name) if a not in sizes]
    if unknown:
      _fail("logical_axis_rules", f"{name!r} maps to unknown mesh axes {unknown}", f"use axes of {list(sizes)}")
  for name, fields in _logical_dims(c).items():
    n = sharding.shards(c, name, sizes)
    for field, size in fields:
      if size % n:
        _fail(field, f"{size} is not divisible by the {n} shards of logical axis {name!r} "
              f"(mesh {sizes}, rule {dict(rules).get(name)!r})", "change the mesh or logical_axis_rules")
  chapter_axes = {a for a in sharding.mesh_axes_of(rules, "chapters") if sizes[a] > 1}
  if chapter_axes - set(sharding.mesh_axes_of(rules, "batch")):
    _fail("logical_axis_rules", f"the bank's chapters are split over {sorted(chapter_axes)} but 'batch' is not",
          "add those mesh axes to the 'batch' rule (the memory axis carries its own slice of the batch)")


def memory_layers(c) -> tuple[int, ...]:
  """Sorted indices of the layers that read memory (MoC-PT's placement rules)."""
  m, mem = c.model, c.memory
  L = m.num_layers
  if not mem.enabled or mem.placement == "none":
    return ()
  return tuple({
      "all": lambda: range(L),
      "first_k": lambda: range(min(mem.placement_k, L)),
      "last_k": lambda: range(max(L - mem.placement_k, 0), L),
      "every_n": lambda: range(0, L, mem.placement_n),
      "custom": lambda: sorted(i for i in mem.layer_indices if 0 <= i < L),
  }[mem.placement]())


def bank_ids(c) -> tuple[int, ...]:
  """Bank index read by each memory layer, in memory-layer order."""
  n = len(memory_layers(c))
  return tuple({"shared": lambda i: 0, "per_layer": lambda i: i,
                "every_k_layers": lambda i: i // c.memory.sharing_k}[c.memory.sharing](i) for i in range(n))


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How the layer stack is built: `num_groups` copies of a `period`-layer group.

  scanned: groups are stacked and run under `lax.scan` (placement periodic, banks scannable);
  otherwise one group holds every layer, unrolled.
  """
  period: int
  num_groups: int
  memory_offsets: tuple[int, ...]  # positions inside a group that read memory
  scanned: bool


def layer_plan(c) -> LayerPlan:
  L = c.model.num_layers
  mem_layers = memory_layers(c)
  unrolled = LayerPlan(L, 1, mem_layers, False)
  if not c.model.scan_layers:
    return unrolled
  if c.memory.enabled and c.memory.sharing == "every_k_layers" and c.memory.sharing_k > 1:
    return unrolled
  for period in range(1, L + 1):
    if L % period:
      continue
    offsets = tuple(i for i in mem_layers if i < period)
    expected = {o + g * period for g in range(L // period) for o in offsets}
    if expected == set(mem_layers) and len(offsets) <= 1:
      if L // period == 1:
        return unrolled
      return LayerPlan(period, L // period, offsets, True)
  return unrolled
