"""MoC-PT's configs (YAML `model:`, `memory:`, `training:` sections, their field names) as moc_jax configs.

Omitted fields take MoC-PT's dataclass defaults (memory_transformer/config.py in the authors' code; see
docs/mocpt_semantics.md); unknown fields are rejected, as MoC-PT's dataclasses do. `config_from_mocpt`
maps the model and memory sections (and refuses what we do not implement, naming the field);
`config_from_yaml` adds the training recipe (`train.*` / `data.*`). Datasets and tokenizers are Hugging Face names there,
so `data.name` / `data.tokenizer` keep our defaults.
`model.chat_template` (written by the MoC-PT version that saved the checkpoints' config.yaml; tokenizer
formatting only) is accepted and not used.
"""
from __future__ import annotations

import logging
import os
import re

import yaml

from moc_jax.config import base_config, resolve_path, validate
from moc_jax.errors import ConfigError


_UNSUPPORTED = {  # (section, field): (value(s) we support, why)
    ("model", "use_rope"): ((True,), "only RoPE models are implemented"),
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
  train, infer = (mm.get(f"routing_strategy_{phase}", "sequence") for phase in ("train", "inference"))
  # rolling / hybrid are KV-cache strategies: without a cache MoC-PT routes them as `sequence`
  cache_only = infer in ("rolling", "hybrid") and train == "sequence"
  if train not in ("sequence", "token") or (infer != train and not cache_only):
    raise ConfigError(f"MoC-PT memory.routing_strategy_train={train!r}, _inference={infer!r}: a forward routes one "
                      "way here — set both to 'sequence' or both to 'token' (inference 'rolling' or 'hybrid' "
                      "with train 'sequence' is cached decoding: memory.decode_routing)")
  c = base_config()
  heads = mc["num_heads"]
  kv_heads = mc.get("num_kv_heads") or heads
  c.model.update(
      vocab_size=mc["vocab_size"], d_model=mc["hidden_dim"], num_layers=mc["num_layers"], num_heads=heads,
      num_kv_heads=kv_heads, mlp_dim=mc["intermediate_dim"],
      hidden_activation=str(mc.get("hidden_activation", "swiglu")).lower(),  # MoC-PT lower-cases it too
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
      token_norm_eps=float(mm.get("shared_routed_norm_eps", 1e-6)), routing=train,
      decode_routing=infer if cache_only else "auto", routing_window=int(mm.get("routing_window_size", 128)),
      init_std=mm.get("memory_init_std", 0.02), wo_init_zero=mm.get("wo_init_zero", True),
      load_balance_coef=mm["load_balance_coefficient"] if mm.get("use_load_balance_loss", True) else 0.0,
      z_loss_coef=mm["z_loss_coefficient"] if mm.get("use_z_loss", False) else 0.0,
      mse_aux_coef=mm["auxiliary_loss_coefficient"] if mm.get("use_auxiliary_loss", False) else 0.0)
  c.memory.dim = mm.get("memory_dim")
  validate(c)
  return c


MODEL_DEFAULTS = dict(
    hidden_dim=768, num_heads=12, num_kv_heads=None, num_layers=12, intermediate_dim=3072, vocab_size=32000,
    max_seq_len=8192, max_position_embeddings=None, tokenizer_name=None, bos_token_id=None, eos_token_id=None,
    pad_token_id=None, chat_template=None, use_rope=True, rope_theta=10000.0, dropout=0.0, attention_dropout=0.0,
    hidden_activation="swiglu", initializer_range=0.02, self_attn_wo_init_std=None, mlp_down_proj_init_std=None,
    norm_eps=1e-6, use_rms_norm=True, base_model_name=None, freeze_base_model=True, use_flash_attention=True,
    tie_embeddings=True)

MEMORY_DEFAULTS = dict(
    vanilla_mode=False, use_memory_adapter=True, use_both_memory_and_lora=False, num_memory_tokens=1024,
    memory_dim=None, memory_num_heads=None, memory_num_kv_heads=None, memory_layer_placement="all",
    memory_layer_k=5, memory_layer_n=3, memory_layer_indices=None, memory_sharing="shared", memory_sharing_k=2,
    memory_block_variant="A", memory_dropout=None, memory_gradient_checkpointing=True,
    use_low_rank_memory=False, memory_rank=64, low_rank_mode="factorized", use_low_rank_projections=False,
    projection_rank=64, use_chapters=False, num_chapters=100, top_k_chapters=20, num_shared_chapters=0,
    routed_scaling_factor=1.0, normalize_shared_routed_before_mixing=False, shared_routed_norm_type="rms",
    shared_routed_norm_eps=1e-6, routing_strategy_train="sequence", routing_strategy_inference="sequence",
    routing_window_size=128, token_routing_kernel_version="v2", use_load_balance_loss=True,
    load_balance_coefficient=0.01, use_auxiliary_loss=False, auxiliary_loss_coefficient=0.01, use_z_loss=False,
    z_loss_coefficient=0.001, quantize_memory=False, memory_quant_bits=8, wo_init_zero=True,
    memory_init_std=0.02, use_lora=False, lora_rank=16, lora_alpha=32, lora_dropout=0.05,
    lora_targets=["q_proj", "v_proj"])

TRAINING_DEFAULTS = dict(
    memory_lr=1e-4, memory_bank_lr=None, lora_lr=1e-4, base_model_lr=1e-5,
    training_mode="instruction_finetuning", dataset_name="HuggingFaceH4/ultrachat_200k", dataset_subset=None,
    dataset_split="train", eval_split="test", text_field="messages", max_length=8192,
    distributed_strategy="ddp", num_gpus=1, fsdp_sharding_strategy="FULL_SHARD",
    batch_size=4, gradient_accumulation_steps=4, num_epochs=None, max_steps=10000, warmup_steps=100,
    warmup_ratio=None, optimizer="adamw", weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
    max_grad_norm=1.0, scheduler="cosine", min_lr_ratio=0.1, decay_start_step=None, decay_start_ratio=None,
    wsd_stable_steps=None, wsd_stable_ratio=0.0, mixed_precision="bf16", save_precision=None,
    gradient_checkpointing=True, save_steps=500, eval_steps=500, save_total_limit=3, save_best_model=True,
    early_stopping=False, early_stopping_patience=5, early_stopping_threshold=0.0, logging_steps=10,
    log_to_wandb=False, wandb_project="memory-transformer", wandb_run_name=None, output_dir="./outputs",
    resume_from_checkpoint=None, init_from_checkpoint=None)

_DEFAULTS = {"model": MODEL_DEFAULTS, "memory": MEMORY_DEFAULTS, "training": TRAINING_DEFAULTS}
_COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}


class _Loader(yaml.SafeLoader):
  """Reads `6e-4` as a float: MoC-PT loads through OmegaConf (YAML 1.2 numbers); PyYAML alone keeps a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _sections(path):
  """{section: MoC-PT dataclass defaults overlaid with the file's fields}, and under `given` the set of
  (section, field) the file itself sets."""
  with open(path) as f:
    raw = yaml.load(f, Loader=_Loader) or {}
  unknown = sorted(set(raw) - set(_DEFAULTS))
  if unknown:
    raise ConfigError(f"MoC-PT config {path}: unknown sections {unknown}; expected {sorted(_DEFAULTS)}")
  out = {}
  for section, defaults in _DEFAULTS.items():
    given = raw.get(section) or {}
    bad = sorted(set(given) - set(defaults))
    if bad:
      raise ConfigError(f"MoC-PT config {path}: unknown {section} fields {bad}")
    out[section] = {**defaults, **given}
  out["given"] = {(section, field) for section in _DEFAULTS for field in raw.get(section) or {}}
  return out


def _schedule(t, for_import):
  """(steps, warmup, decay_start_step) per MoC-PT: warmup_ratio overrides warmup_steps; a WSD run without
  decay_start_* decays after warmup + wsd_stable_steps (or int(steps * wsd_stable_ratio))."""
  if t["num_epochs"] is not None:
    message = (f"MoC-PT training.num_epochs={t['num_epochs']}: the step count would depend on the dataset "
               "length — set training.max_steps instead")
    if not for_import:
      raise ConfigError(message)
    logging.getLogger("moc_jax").warning("%s (imported: the schedule uses max_steps=%s)", message, t["max_steps"])
  steps = t["max_steps"]
  warmup = int(steps * t["warmup_ratio"]) if t["warmup_ratio"] is not None else t["warmup_steps"]
  decay_start = t["decay_start_step"]
  if decay_start is None and t["decay_start_ratio"] is None and t["scheduler"].lower() == "wsd":
    stable = t["wsd_stable_steps"] if t["wsd_stable_steps"] is not None else int(steps * t["wsd_stable_ratio"])
    decay_start = warmup + stable
  return steps, warmup, decay_start


def config_from_yaml(arg: str, for_import: bool = False):
  """Our (unvalidated) config equivalent to the MoC-PT YAML (or JSON) file `arg`: relative to the working
  directory, or a `configs/...` path among the packaged configs. `for_import`: a run length given as
  `training.num_epochs` is kept as `max_steps` with a warning instead of refused (an imported checkpoint is
  evaluated, not trained to that length)."""
  try:
    path = resolve_path(arg)
  except ConfigError:
    raise ConfigError(f"MoC-PT config {arg!r} not found; pass e.g. configs/mocpt.py:"
                      "configs/mocpt_examples/base_small_run2.yaml") from None
  s = _sections(path)
  t = s["training"]
  if t["mixed_precision"] not in _COMPUTE_DTYPES:
    raise ConfigError(f"MoC-PT training.mixed_precision={t['mixed_precision']!r}: use one of {list(_COMPUTE_DTYPES)}")
  optimizer = t["optimizer"].lower()
  if optimizer not in ("adamw", "adam"):
    raise ConfigError(f"MoC-PT training.optimizer={t['optimizer']!r}: only adamw and adam are implemented")
  steps, warmup, decay_start = _schedule(t, for_import)
  c = config_from_mocpt(s["model"], s["memory"], compute_dtype=_COMPUTE_DTYPES[t["mixed_precision"]])
  c.name = f"mocpt-{os.path.splitext(os.path.basename(path))[0]}"
  c.train.update(
      base_lr=t["base_model_lr"], memory_lr=t["memory_lr"], bank_lr=t["memory_bank_lr"],
      batch_size=t["batch_size"] * t["num_gpus"],  # theirs is per device, ours is global
      grad_accum=t["gradient_accumulation_steps"], steps=steps, warmup_steps=warmup,
      schedule=t["scheduler"].lower(), decay_start_step=decay_start, decay_start_ratio=t["decay_start_ratio"],
      min_lr_ratio=t["min_lr_ratio"], weight_decay=0.0 if optimizer == "adam" else t["weight_decay"],
      b1=t["adam_beta1"], b2=t["adam_beta2"], eps=t["adam_epsilon"], clip_norm=t["max_grad_norm"],
      log_every=t["logging_steps"], eval_every=t["eval_steps"], checkpoint_every=t["save_steps"])
  if t["save_total_limit"] is not None:  # null keeps every checkpoint in MoC-PT; ours keeps the default
    c.train.keep_checkpoints = t["save_total_limit"]
  c.model.remat = "full" if t["gradient_checkpointing"] else "none"
  # MoC-PT's RoPE cache grows on demand, so max_seq_len never caps the training length.
  length = t["max_length"]
  if for_import and ("training", "max_length") not in s["given"]:
    length = _import_length(path, length, c.model.max_seq_len)
  c.model.max_seq_len = max(c.model.max_seq_len, length)
  c.data.seq_len = length
  c.data.layout = "pad_truncate"  # MoC-PT never packs: one truncated, right-padded document per row
  return c


IMPORT_LENGTH = 2048  # the longest length the published MoC-PT runs trained at (docs/mocpt_semantics.md)


def _import_length(path, default, max_seq_len):
  """The evaluation length of an imported config whose file sets no training.max_length: MoC-PT's default
  (8192) would pad every evaluation row to it (pad_truncate) and exhaust memory, so the shorter of the model's
  max_seq_len and IMPORT_LENGTH is used, with one warning naming the field."""
  length = min(default, max_seq_len, IMPORT_LENGTH)
  if length != default:
    logging.getLogger("moc_jax").warning(
        "MoC-PT config %s sets no training.max_length (default %d): data.seq_len=%d used for the imported run "
        "(set training.max_length in the file, or --config.data.seq_len=N when evaluating)", path, default, length)
  return length


def load_mocpt_config(path: str):
  """Our locked config for a MoC-PT YAML (`model`, `memory` and optionally `training` sections; their
  dataclass defaults fill the rest) or a JSON with the same sections: configs/mocpt.py reads both (as
  `PATH,import`: a checkpoint's `training.num_epochs` is not an error), so compute is bf16 unless
  `training.mixed_precision` says otherwise, as MoC-PT trains."""
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file")
  config = config_from_yaml(os.path.abspath(path), for_import=True)
  validate(config)
  config.lock()
  return config
