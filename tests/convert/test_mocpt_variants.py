"""moc_jax against the float64 numpy MoC-PT oracle across MoC-PT config variants.

The oracle (tests/convert/mocpt_numpy.py) is pinned to MoC-PT's own outputs by test_mocpt_numpy_fixture.py.
Each variant here starts from that fixture's MoC-PT config, changes a few fields, draws a random
state_dict in MoC-PT's layout plus a right-padded batch, loads the state through `load_mocpt_state`
and compares chapter choices, logits, eval CE and train CE + router aux (float32, rel. error <= 1e-5).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.convert.mocpt import load_mocpt_state
from moc_jax.convert.mocpt_config import config_from_mocpt
from tests.convert.mocpt_numpy import memory_layer_indices, mocpt_forward, random_mocpt_state
from tests.convert.mocpt_numpy import next_token_ce as np_next_token_ce

try:
  from moc_jax.losses import next_token_ce
except ImportError:  # the comparison does not depend on the training loss module
  def next_token_ce(logits, labels):
    return np_next_token_ce(np.asarray(logits), np.asarray(labels))

FIXTURE = next((p for p in (os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "moc_pt_paper_small.npz"),
                             "/work/shared/fixtures/moc_pt_paper_small.npz") if os.path.exists(p)), "")
TOL = 1e-5
BATCH, SEQ = 3, 12
MIN_ROUTER_MARGIN = 1e-3  # logit gap at the top-k boundary; float32 rounding is ~1e-6 here
# These models are tiny, so XLA compile time dominates; backend optimisation does not change semantics.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# The fixture's effective MoC-PT config (used verbatim when the fixture is present): hidden 64, 4 layers,
# heads 4 / kv 2, memory heads 4/4 at layers [1, 3], 17 chapters x 8 tokens, 1 shared, top-4, factor 2.5,
# rms token norm eps 1e-5, load-balance 0.01 + z-loss 0.001.
_FALLBACK_MODEL = dict(hidden_dim=64, num_heads=4, num_kv_heads=2, num_layers=4, intermediate_dim=128,
                       vocab_size=97, max_seq_len=64, max_position_embeddings=64, use_rope=True,
                       rope_theta=1e5, dropout=0.0, attention_dropout=0.0, hidden_activation="swiglu",
                       initializer_range=0.02, self_attn_wo_init_std=0.00378, mlp_down_proj_init_std=0.00378,
                       norm_eps=1e-5, use_rms_norm=True, base_model_name=None, tie_embeddings=True)
_FALLBACK_MEMORY = dict(vanilla_mode=False, num_memory_tokens=136, memory_dim=None, memory_num_heads=4,
                        memory_num_kv_heads=4, memory_layer_placement="custom", memory_layer_k=5,
                        memory_layer_n=3, memory_layer_indices=[1, 3], memory_sharing="shared",
                        memory_sharing_k=2, memory_block_variant="A", use_low_rank_memory=False,
                        use_low_rank_projections=False, use_chapters=True, num_chapters=17, top_k_chapters=4,
                        num_shared_chapters=1, routed_scaling_factor=2.5,
                        normalize_shared_routed_before_mixing=True, shared_routed_norm_type="rms",
                        shared_routed_norm_eps=1e-5, routing_strategy_train="sequence",
                        routing_strategy_inference="sequence", use_load_balance_loss=True,
                        load_balance_coefficient=0.01, use_auxiliary_loss=False, auxiliary_loss_coefficient=0.01,
                        use_z_loss=True, z_loss_coefficient=0.001, quantize_memory=False, wo_init_zero=True,
                        memory_init_std=0.02, use_lora=False, use_memory_adapter=True)


def _base_configs():
  if os.path.exists(FIXTURE):
    meta = json.loads(str(np.load(FIXTURE)["meta_json"]))
    return meta["model"], meta["memory"]
  return dict(_FALLBACK_MODEL), dict(_FALLBACK_MEMORY)


# id -> (model overrides, memory overrides, right-padded batch?). Each variant moves several axes at
# once so every value of every axis is covered without one compile per value.
VARIANTS = {
    "paper_small": ({}, {}, True),
    # s = 0: MoC-PT ignores routed_scaling_factor and skips the token norm
    "shared0_factor2.5_all_per_layer": ({}, {"num_shared_chapters": 0, "memory_layer_placement": "all",
                                             "memory_sharing": "per_layer"}, True),
    "shared0_top8_every_n2_per_layer": ({}, {"num_shared_chapters": 0, "top_k_chapters": 8,
                                             "memory_layer_placement": "every_n", "memory_layer_n": 2,
                                             "memory_sharing": "per_layer"}, True),
    "shared2_factor5_layernorm_first_k2": ({}, {"num_shared_chapters": 2, "routed_scaling_factor": 5.0,
                                                "shared_routed_norm_type": "layernorm",
                                                "memory_layer_placement": "first_k", "memory_layer_k": 2}, True),
    "factor1_memgqa_4q2kv_last_k3_every_k2": ({}, {"routed_scaling_factor": 1.0, "memory_num_heads": 4,
                                                   "memory_num_kv_heads": 2, "memory_layer_placement": "last_k",
                                                   "memory_layer_k": 3, "memory_sharing": "every_k_layers",
                                                   "memory_sharing_k": 2}, True),
    "memmqa_8q1kv_sa_mha4_every_n2": ({"num_kv_heads": 4}, {"memory_num_heads": 8, "memory_num_kv_heads": 1,
                                                            "memory_layer_placement": "every_n",
                                                            "memory_layer_n": 2}, True),
    "memheads_default_sa_mqa1": ({"num_kv_heads": 1}, {"memory_num_heads": None, "memory_num_kv_heads": None},
                                 True),
    "variant_B_norm_off": ({}, {"memory_block_variant": "B", "normalize_shared_routed_before_mixing": False},
                           True),
    "variant_B_all_every_k3_layernorm_eps1e-2": ({}, {"memory_block_variant": "B", "memory_layer_placement": "all",
                                                      "memory_sharing": "every_k_layers", "memory_sharing_k": 3,
                                                      "shared_routed_norm_type": "layernorm",
                                                      "shared_routed_norm_eps": 1e-2}, True),
    "custom_3_0_2_memdim48_zloss_off": ({}, {"memory_layer_indices": [3, 0, 2], "memory_dim": 48,
                                             "use_z_loss": False}, True),
    "topk_clamped_aux_on_lb_off": ({}, {"num_memory_tokens": 64, "num_chapters": 8, "top_k_chapters": 8,
                                        "num_shared_chapters": 2, "use_load_balance_loss": False,
                                        "use_auxiliary_loss": True, "auxiliary_loss_coefficient": 5.0}, True),
    "all_router_losses_unpadded": ({}, {"use_auxiliary_loss": True, "auxiliary_loss_coefficient": 5.0,
                                        "load_balance_coefficient": 0.05, "z_loss_coefficient": 0.01}, False),
    # MoC-PT's plain MLPs (no gate_proj), in the block's MLP and variant B's post-memory one
    "gelu_variant_B": ({"hidden_activation": "gelu"}, {"memory_block_variant": "B"}, True),
    "relu_shared0_all": ({"hidden_activation": "relu"}, {"num_shared_chapters": 0, "memory_layer_placement": "all"},
                         True),
    "silu_upper_case": ({"hidden_activation": "SiLU"}, {}, True),
    "sigmoid": ({"hidden_activation": "sigmoid"}, {}, False),
    "tanh": ({"hidden_activation": "tanh"}, {}, True),
    "mixed_B_sa_mqa_memgqa_shared2_layernorm": ({"num_kv_heads": 1},
                                                {"memory_block_variant": "B", "memory_num_heads": 8,
                                                 "memory_num_kv_heads": 2, "num_shared_chapters": 2,
                                                 "routed_scaling_factor": 5.0, "shared_routed_norm_type": "layernorm",
                                                 "memory_layer_placement": "last_k", "memory_layer_k": 2,
                                                 "memory_sharing": "per_layer"}, True),
}


def _variant_configs(name):
  model_cfg, memory_cfg = _base_configs()
  model_over, memory_over, padded = VARIANTS[name]
  return {**model_cfg, **model_over}, {**memory_cfg, **memory_over}, padded


def _batch(vocab, padded, rng):
  """Right-padded like MoC-PT's collator: pad id 0, attention_mask 0, label -100 on the pads."""
  ids = rng.integers(1, vocab, size=(BATCH, SEQ))
  lengths = np.array([SEQ, SEQ - 3, SEQ // 2 - 1]) if padded else np.full(BATCH, SEQ)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask == 1, ids, 0).astype(np.int32)
  labels = np.where(mask == 1, ids, -100).astype(np.int32)
  return ids, mask, labels


def _draw(model_cfg, memory_cfg, padded, seed):
  """Random state + batch + reference outputs, re-drawn until routing is tie-free and per-sequence.

  A near-tie at the top-k boundary may legitimately flip in float32; identical selections for all
  sequences would leave the per-sequence gather untested.
  """
  for attempt in range(50):
    rng = np.random.default_rng([seed, attempt])
    state = random_mocpt_state(model_cfg, memory_cfg, rng)
    ids, mask, labels = _batch(model_cfg["vocab_size"], padded, rng)
    ref = mocpt_forward(model_cfg, memory_cfg, state, ids, mask, train=True, labels=labels, return_info=True)
    info = ref[3]
    if min(info["margin"]) > MIN_ROUTER_MARGIN and all(len({tuple(r) for r in x}) > 1 for x in info["ids"]):
      return state, (ids, mask, labels), ref
  raise AssertionError("no tie-free draw with per-sequence routing in 50 attempts")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _nan_model(config):
  """The model with every parameter NaN: a parameter the loader misses poisons the logits.

  Same architecture as `moc_jax.build_model(config)` (both validate and build `Transformer`), without
  its random init, which costs seconds per variant on CPU and is overwritten by the loader anyway.
  """
  graphdef, params = nnx.split(moc_jax.abstract_model(config))
  return nnx.merge(graphdef, jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), params))


def _run_ours(model_cfg, memory_cfg, state, ids, mask):
  """Our model, loaded from the MoC-PT state; one compile returns the train- and eval-mode outputs."""
  config = config_from_mocpt(model_cfg, memory_cfg, compute_dtype="float32")
  model = _nan_model(config)
  load_mocpt_state(model, state)
  graphdef, params = nnx.split(model)

  def both(params, ids, mask):
    m = nnx.merge(graphdef, params)
    return m(ids, mask, train=True), m(ids, mask, train=False)

  args = (params, jnp.asarray(ids), jnp.asarray(mask))
  compiled = jax.jit(both).lower(*args).compile(compiler_options=FAST_COMPILE)
  return compiled(*args)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_mocpt_reference(name):
  model_cfg, memory_cfg, padded = _variant_configs(name)
  state, (ids, mask, labels), (ref_logits, ref_ce, ref_aux, info) = _draw(
      model_cfg, memory_cfg, padded, seed=sum(map(ord, name)))
  assert np.all(np.isfinite(ref_logits))

  (logits, aux), (eval_logits, _) = _run_ours(model_cfg, memory_cfg, state, ids, mask)

  assert memory_layer_indices(model_cfg, memory_cfg) == info["layers"]
  ce_eval = float(next_token_ce(eval_logits, jnp.asarray(labels)))
  ce_train = float(next_token_ce(logits, jnp.asarray(labels)))
  router_loss = float(aux["router_loss"])
  errors = {  # all reported together: the first failing quantity is not always the cause
      "chapter_mismatches": int(np.sum(np.asarray(aux["chapters"]) != np.stack(info["ids"]))),
      "chapter_weights": _rel(aux["weights"], np.stack(info["weights"])),
      "logits_train": _rel(logits, ref_logits),
      "logits_eval": _rel(eval_logits, ref_logits),
      "ce_eval": _rel(ce_eval, ref_ce),
      "ce_plus_aux_train": _rel(ce_train + router_loss, ref_ce + ref_aux),
      "router_loss": abs(router_loss - ref_aux) / max(abs(ref_aux), 1e-4),  # aux alone, not hidden in CE
  }
  bad = {k: v for k, v in errors.items() if not v <= (0 if k == "chapter_mismatches" else TOL)}
  assert not bad, f"{name}: {bad} (all: {errors})"


# Each listed field flip must move the oracle's outputs far beyond TOL on the variant draws above,
# otherwise the variant comparison could not tell a port that ignores the field from one that honours it.
SENSITIVITY = {
    "routed_scaling_factor": ("paper_small", {"routed_scaling_factor": 1.0}),
    "num_shared_chapters": ("paper_small", {"num_shared_chapters": 2}),
    "token_norm_type": ("paper_small", {"shared_routed_norm_type": "layernorm"}),
    "token_norm_on": ("variant_B_norm_off", {"normalize_shared_routed_before_mixing": True}),
    "token_norm_eps": ("variant_B_all_every_k3_layernorm_eps1e-2", {"shared_routed_norm_eps": 1e-5}),
    "block_variant": ("paper_small", {"memory_block_variant": "B"}),
}


@pytest.mark.parametrize("field", list(SENSITIVITY))
def test_variant_draws_are_sensitive(field):
  name, flip = SENSITIVITY[field]
  model_cfg, memory_cfg, padded = _variant_configs(name)
  state, (ids, mask, labels), (ref_logits, _, _, _) = _draw(model_cfg, memory_cfg, padded,
                                                            seed=sum(map(ord, name)))
  flipped = {**memory_cfg, **flip}
  if flip.get("memory_block_variant") == "B":  # variant B needs its extra weights
    extra = random_mocpt_state(model_cfg, flipped, 0)
    state = {**extra, **state}
  logits, _, _ = mocpt_forward(model_cfg, flipped, state, ids, mask, labels=labels)
  assert _rel(logits, ref_logits) > 100 * TOL


def test_bank_sharing_is_visible():
  """per_layer vs shared banks (same draw, bank 0 reused) must differ, so sharing bugs are caught."""
  model_cfg, memory_cfg, padded = _variant_configs("shared0_factor2.5_all_per_layer")
  state, (ids, mask, labels), (ref_logits, _, _, _) = _draw(
      model_cfg, memory_cfg, padded, seed=sum(map(ord, "shared0_factor2.5_all_per_layer")))
  shared = {**memory_cfg, "memory_sharing": "shared"}
  logits, _, _ = mocpt_forward(model_cfg, shared, state, ids, mask, labels=labels)
  assert _rel(logits, ref_logits) > 100 * TOL
