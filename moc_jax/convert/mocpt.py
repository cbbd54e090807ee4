"""MoC-PT (the authors' PyTorch code) -> moc_jax: config fields and state_dict tensors.

`config_from_mocpt` maps their `model:` / `memory:` sections (reference_spec.md §2) onto our config and
refuses what we do not implement (naming the field). `param_map` lists, for every MoC-PT tensor, where it
lives in our parameter tree and how its layout differs; loading and gradient comparison both use it.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
from flax import nnx

from moc_jax.config import REPO_ROOT, ConfigError, bank_ids, layer_plan, memory_layers, validate


def _base_config():
  sys.path.insert(0, os.path.join(REPO_ROOT, "configs"))
  import common  # configs are code; the base holds every field
  return common.base_config()


_UNSUPPORTED = {  # (section, field): (value(s) we support, why)
    ("model", "use_rope"): ((True,), "only RoPE models are implemented"),
    ("model", "hidden_activation"): (("swiglu",), "only SwiGLU is implemented"),
    ("model", "use_rms_norm"): ((True,), "only RMSNorm is implemented"),
    ("model", "tie_embeddings"): ((True,), "only tied embeddings are implemented"),
    ("model", "base_model_name"): ((None,), "adapter mode on a pretrained HF model is not implemented"),
    ("memory", "use_low_rank_memory"): ((False,), "low-rank banks are not implemented"),
    ("memory", "use_low_rank_projections"): ((False,), "low-rank projections are not implemented"),
    ("memory", "quantize_memory"): ((False,), "bank quantisation is not implemented"),
    ("memory", "use_lora"): ((False,), "LoRA is adapter-mode only"),
    ("memory", "use_chapters"): ((True,), "un-chaptered banks are not implemented (use 1 shared chapter)"),
    ("model", "dropout"): ((0, 0.0), "dropout is not implemented (every MoC-PT run used 0)"),
    ("model", "attention_dropout"): ((0, 0.0), "attention dropout is not implemented"),
    ("memory", "memory_dropout"): ((None, 0, 0.0), "memory dropout is not implemented"),
}


def config_from_mocpt(model_cfg: dict, memory_cfg: dict, compute_dtype: str = "bfloat16"):
  """Our validated config equivalent to MoC-PT's effective `model` and `memory` sections."""
  for (section, field), (ok, why) in _UNSUPPORTED.items():
    value = (model_cfg if section == "model" else memory_cfg).get(field, ok[0])
    if value not in ok:
      raise ConfigError(f"MoC-PT {section}.{field}={value!r}: {why}")
  mc, mm = model_cfg, memory_cfg
  routing = {mm.get(f"routing_strategy_{phase}", "sequence") for phase in ("train", "inference")}
  if len(routing) != 1 or not routing <= {"sequence", "token"}:
    raise ConfigError(f"MoC-PT memory.routing_strategy_train/_inference={sorted(routing)}: one model routes one "
                      "way here — set both to 'sequence' or both to 'token'")
  c = _base_config()
  heads = mc["num_heads"]
  kv_heads = mc.get("num_kv_heads") or heads
  c.model.update(
      vocab_size=mc["vocab_size"], d_model=mc["hidden_dim"], num_layers=mc["num_layers"], num_heads=heads,
      num_kv_heads=kv_heads, mlp_dim=mc["intermediate_dim"],
      max_seq_len=mc.get("max_position_embeddings") or mc.get("max_seq_len", 8192),
      rope_theta=float(mc["rope_theta"]), norm_eps=float(mc["norm_eps"]),
      init_std=mc["initializer_range"],
      attn_out_init_std=mc.get("self_attn_wo_init_std") or mc["initializer_range"],
      mlp_out_init_std=mc.get("mlp_down_proj_init_std") or mc["initializer_range"],
      compute_dtype=compute_dtype)
  c.data.seq_len = c.model.max_seq_len  # MoC-PT's training length lives in its `training:` section
  enabled = not mm.get("vanilla_mode", False) and mm.get("use_memory_adapter", True)
  c.memory.enabled = bool(enabled)
  if not enabled:
    c.memory.placement = "none"
    validate(c)
    return c
  chapters, shared = mm["num_chapters"], mm.get("num_shared_chapters", 0)
  norm = mm.get("shared_routed_norm_type", "rms") if mm.get("normalize_shared_routed_before_mixing") else "none"
  c.memory.update(
      num_tokens=mm["num_memory_tokens"], num_chapters=chapters, num_shared=shared,
      top_k=min(mm["top_k_chapters"], chapters - shared),  # MoC-PT selects min(top_k, C - s)
      routed_scaling_factor=float(mm.get("routed_scaling_factor", 1.0)),
      num_heads=mm.get("memory_num_heads") or heads,
      num_kv_heads=mm.get("memory_num_kv_heads") or kv_heads,
      placement=mm["memory_layer_placement"], placement_k=mm.get("memory_layer_k", 5),
      placement_n=mm.get("memory_layer_n", 3), layer_indices=tuple(mm.get("memory_layer_indices") or ()),
      sharing=mm.get("memory_sharing", "shared"), sharing_k=mm.get("memory_sharing_k", 2),
      block_variant=mm.get("memory_block_variant", "A"), token_norm=norm,
      token_norm_eps=float(mm.get("shared_routed_norm_eps", 1e-6)), routing=routing.pop(),
      init_std=mm.get("memory_init_std", 0.02), wo_init_zero=mm.get("wo_init_zero", True),
      load_balance_coef=mm["load_balance_coefficient"] if mm.get("use_load_balance_loss", True) else 0.0,
      z_loss_coef=mm["z_loss_coefficient"] if mm.get("use_z_loss", False) else 0.0,
      mse_aux_coef=mm["auxiliary_loss_coefficient"] if mm.get("use_auxiliary_loss", False) else 0.0)
  c.memory.dim = mm.get("memory_dim")
  validate(c)
  return c


@dataclasses.dataclass(frozen=True)
class Entry:
  """One MoC-PT tensor: our parameter path, its slot on a stacked axis (or None), and its layout kind."""
  path: tuple
  index: int | None
  kind: str  # "same" | "linear" (torch [out,in] -> ours [in,out]) | "bank" ([N,d] -> [C,T,d] at bank id)

  def to_ours(self, t, leaf_shape):
    if self.kind == "linear":
      return t.T
    if self.kind == "bank":
      return t.reshape(leaf_shape[1:])
    return t

  def from_ours(self, a):
    a = a if self.index is None else a[self.index]
    if self.kind == "linear":
      return a.T
    if self.kind == "bank":
      return a.reshape(-1, a.shape[-1])
    return a


def param_map(config) -> dict[str, Entry]:
  """{MoC-PT state_dict key: Entry} for every parameter of the equivalent model (buffers excluded)."""
  plan = layer_plan(config)
  entries = {"embed_tokens.weight": Entry(("embed", "embedding"), None, "same"),
             "norm.weight": Entry(("final_norm", "scale"), None, "same")}
  mem_layers = memory_layers(config)
  for b in sorted(set(bank_ids(config))):
    entries[f"memory_banks.{b}.base_bank.memory"] = Entry(("bank", "memory"), b, "bank")
  for i in range(config.model.num_layers):
    g, j = divmod(i, plan.period)
    index = g if plan.scanned else None
    blk = ("layers", "blocks", j)

    def add(key, sub, kind):
      entries[key] = Entry(blk + sub, index, kind)

    add(f"layers.{i}.input_layernorm.weight", ("attn_norm", "scale"), "same")
    add(f"layers.{i}.post_attention_layernorm.weight", ("mlp_norm", "scale"), "same")
    for n in "qkvo":
      add(f"layers.{i}.self_attn.{n}_proj.weight", ("attn", n, "kernel"), "linear")
    for n in ("gate", "up", "down"):
      add(f"layers.{i}.mlp.{n}_proj.weight", ("mlp", n, "kernel"), "linear")
    if i in mem_layers:
      add(f"layers.{i}.memory_layernorm.weight", ("memory", "norm", "scale"), "same")
      for n in "qkvo":
        add(f"layers.{i}.memory_attn.{n}_proj.weight", ("memory", "attn", n, "kernel"), "linear")
      add(f"routers.{i}.router.weight", ("memory", "router", "proj", "kernel"), "linear")
      add(f"routers.{i}.router.bias", ("memory", "router", "proj", "bias"), "same")
      if config.memory.block_variant == "B":
        add(f"layers.{i}.post_memory_layernorm.weight", ("post_memory_norm", "scale"), "same")
        for n in ("gate", "up", "down"):
          add(f"layers.{i}.post_memory_mlp.{n}_proj.weight", ("post_memory_mlp", n, "kernel"), "linear")
  return entries


def _check_buffers(config, state_dict):
  """RoPE inv_freq buffers and the tied head must agree with what our model computes / ties."""
  if "lm_head.weight" in state_dict and not np.array_equal(state_dict["lm_head.weight"],
                                                           state_dict["embed_tokens.weight"]):
    raise ConfigError("MoC-PT lm_head.weight differs from embed_tokens.weight: only tied heads are supported")
  d = config.model.d_model // config.model.num_heads
  expected = 1.0 / config.model.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  for key, value in state_dict.items():
    if key.endswith("rotary.inv_freq") and not np.allclose(value, expected, rtol=1e-6):
      raise ConfigError(f"MoC-PT {key} does not match rope_theta={config.model.rope_theta}")


def load_mocpt_state(model, state_dict) -> None:
  """Copies a MoC-PT state_dict (numpy arrays, their key names) into `model` in place."""
  config = model.cfg
  _check_buffers(config, state_dict)
  entries = param_map(config)
  missing = sorted(set(entries) - set(state_dict))
  extra = sorted(k for k in state_dict if k not in entries and not k.endswith("rotary.inv_freq")
                 and k != "lm_head.weight")
  if missing or extra:
    raise ConfigError(f"MoC-PT state_dict does not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
  state = nnx.state(model, nnx.Param)
  pure = state.to_pure_dict()
  arrays = {}
  for key, e in entries.items():
    leaf = _get(pure, e.path)
    arr = arrays.setdefault(e.path, np.array(leaf, dtype=np.float32))
    value = e.to_ours(np.asarray(state_dict[key], np.float32), arr.shape)
    if e.index is None:
      if value.shape != arr.shape:
        raise ConfigError(f"MoC-PT {key}: shape {np.shape(state_dict[key])} does not fit {arr.shape}")
      arr[...] = value
    else:
      if value.shape != arr.shape[1:]:
        raise ConfigError(f"MoC-PT {key}: shape {np.shape(state_dict[key])} does not fit {arr.shape[1:]}")
      arr[e.index] = value
  for path, arr in arrays.items():
    _set(pure, path, arr)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)


def to_mocpt(config, tree) -> dict[str, np.ndarray]:
  """Our parameter-shaped pure dict (params or gradients) -> {MoC-PT key: array in their layout}."""
  return {key: np.asarray(e.from_ours(np.asarray(_get(tree, e.path)))) for key, e in param_map(config).items()}


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree[p]
  tree[path[-1]] = value
