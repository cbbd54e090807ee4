"""A float64 numpy re-statement of MoC-PT's forward pass (sequence and token routing), used as a test oracle.

It reads MoC-PT's own `model` / `memory` config dicts and state_dict key names (docs/mocpt_semantics.md#parameter-names,
PyTorch Linear layout [out, in]) and shares no code with `moc_jax`, so agreement between the
two is evidence about the port, not about shared code. Its faithfulness is itself checked
against the PyTorch fixture (tests/convert/test_mocpt_numpy_fixture.py).

Covered: RMSNorm backbone, RoPE, GQA self-attention with causal + key-padding mask, SwiGLU and the plain MLPs of
`hidden_activation` (silu, relu, gelu, sigmoid, tanh), block
variants A and B, every placement and sharing mode, shared + routed chapters, the parameter-free
shared/routed token norm (rms | layernorm), memory GQA, memory_dim != hidden_dim, the
load-balance / z / auxiliary router losses, and the routing strategies "sequence" and "token"
(`routing_strategy_train` in train mode, `routing_strategy_inference` otherwise; the token path is
MoC-PT's CPU route: dense shared branch + per-chapter routed attention, as in its emulated fallback).
Anything else raises NotImplementedError.
"""
from __future__ import annotations

import math

import numpy as np

F64 = np.float64
ROUTING_STRATEGIES = ("sequence", "token")


# ----------------------------------------------------------------------------------------------
# config facts (MoC-PT's rules, restated)


def _resolved(model_cfg: dict, memory_cfg: dict) -> dict:
  """Effective sizes after MoC-PT's None-defaults (memory kv heads fall back to the MODEL's kv heads)."""
  d = model_cfg["hidden_dim"]
  heads = model_cfg["num_heads"]
  kv = model_cfg.get("num_kv_heads") or heads
  mem_heads = memory_cfg.get("memory_num_heads") or heads
  mem_kv = memory_cfg.get("memory_num_kv_heads") or kv
  return dict(d=d, heads=heads, kv=kv, hd=d // heads, mem_heads=mem_heads, mem_kv=mem_kv,
              mem_hd=d // mem_heads, mem_dim=memory_cfg.get("memory_dim") or d)


def _check_supported(model_cfg: dict, memory_cfg: dict) -> None:
  unsupported = {
      "model.hidden_activation": _activation(model_cfg) not in ("swiglu", *_PLAIN),
      "model.use_rms_norm false": not model_cfg.get("use_rms_norm", True),
      "model.base_model_name (adapter mode)": model_cfg.get("base_model_name") is not None,
      "memory.use_chapters false": not memory_cfg.get("use_chapters", False),
      "memory.use_low_rank_memory": memory_cfg.get("use_low_rank_memory", False),
      "memory.use_low_rank_projections": memory_cfg.get("use_low_rank_projections", False),
      "memory.routing_strategy_* not in (sequence, token)": (
          memory_cfg.get("routing_strategy_train", "sequence") not in ROUTING_STRATEGIES
          or memory_cfg.get("routing_strategy_inference", "sequence") not in ROUTING_STRATEGIES),
      "memory.quantize_memory": memory_cfg.get("quantize_memory", False),
  }
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise NotImplementedError(f"mocpt_numpy does not model: {bad}")


def _activation(model_cfg: dict) -> str:
  return str(model_cfg.get("hidden_activation", "swiglu")).lower()


def memory_layer_indices(model_cfg: dict, memory_cfg: dict) -> list[int]:
  """Sorted memory-layer indices (MoC-PT `get_memory_layer_indices`)."""
  n = model_cfg["num_layers"]
  if memory_cfg.get("vanilla_mode", False) or not memory_cfg.get("use_memory_adapter", True):
    return []
  placement = memory_cfg["memory_layer_placement"]
  if placement == "none":
    return []
  if placement == "all":
    return list(range(n))
  if placement == "first_k":
    return list(range(min(memory_cfg["memory_layer_k"], n)))
  if placement == "last_k":
    k = min(memory_cfg["memory_layer_k"], n)
    return list(range(n - k, n))
  if placement == "every_n":
    return list(range(0, n, memory_cfg["memory_layer_n"]))
  if placement == "custom":
    return sorted(i for i in memory_cfg["memory_layer_indices"] if 0 <= i < n)
  raise ValueError(f"unknown memory_layer_placement {placement!r}")


def bank_assignments(model_cfg: dict, memory_cfg: dict) -> dict[int, int]:
  """layer index -> bank index (MoC-PT `get_memory_bank_assignments`)."""
  layers = memory_layer_indices(model_cfg, memory_cfg)
  sharing = memory_cfg["memory_sharing"]
  if sharing == "shared":
    return {l: 0 for l in layers}
  if sharing == "per_layer":
    return {l: i for i, l in enumerate(layers)}
  if sharing == "every_k_layers":
    return {l: i // memory_cfg["memory_sharing_k"] for i, l in enumerate(layers)}
  raise ValueError(f"unknown memory_sharing {sharing!r}")


# ----------------------------------------------------------------------------------------------
# random state


def random_mocpt_state(model_cfg: dict, memory_cfg: dict, seed) -> dict[str, np.ndarray]:
  """A float32 MoC-PT state_dict with every path live (`seed`: int or np.random.Generator).

  Unlike MoC-PT's init, norm gains are random around 1, memory o_proj is non-zero and the router is
  large (std 1), so each sub-module visibly moves the logits and routing differs between sequences.
  `lm_head.weight` is the same array as `embed_tokens.weight` when embeddings are tied.
  """
  _check_supported(model_cfg, memory_cfg)
  rng = np.random.default_rng(seed)
  r = _resolved(model_cfg, memory_cfg)
  d, hd, v, inter = r["d"], r["hd"], model_cfg["vocab_size"], model_cfg["intermediate_dim"]
  theta = float(model_cfg.get("rope_theta", 10000.0))
  gated = _activation(model_cfg) == "swiglu"  # MoC-PT's plain MLPs have no gate_proj

  def normal(shape, std):
    return (std * rng.standard_normal(shape)).astype(np.float32)

  def linear(out_dim, in_dim, gain=1.0):
    return normal((out_dim, in_dim), gain / np.sqrt(in_dim))

  def gain():
    return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)

  state = {"embed_tokens.weight": normal((v, d), 0.2)}
  inv_freq = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
  mem_layers = set(memory_layer_indices(model_cfg, memory_cfg))
  variant = memory_cfg.get("memory_block_variant", "A")
  for i in range(model_cfg["num_layers"]):
    p = f"layers.{i}."
    state[p + "input_layernorm.weight"] = gain()
    state[p + "post_attention_layernorm.weight"] = gain()
    state[p + "self_attn.q_proj.weight"] = linear(d, d)
    state[p + "self_attn.k_proj.weight"] = linear(r["kv"] * hd, d)
    state[p + "self_attn.v_proj.weight"] = linear(r["kv"] * hd, d)
    state[p + "self_attn.o_proj.weight"] = linear(d, d, 0.5)
    state[p + "self_attn.rotary.inv_freq"] = inv_freq.copy()
    if gated:
      state[p + "mlp.gate_proj.weight"] = linear(inter, d)
    state[p + "mlp.up_proj.weight"] = linear(inter, d)
    state[p + "mlp.down_proj.weight"] = linear(d, inter, 0.5)
    if i in mem_layers:
      mkv = r["mem_kv"] * r["mem_hd"]
      state[p + "memory_layernorm.weight"] = gain()
      state[p + "memory_attn.q_proj.weight"] = linear(d, d)
      state[p + "memory_attn.k_proj.weight"] = linear(mkv, r["mem_dim"], 2.0)
      state[p + "memory_attn.v_proj.weight"] = linear(mkv, r["mem_dim"])
      state[p + "memory_attn.o_proj.weight"] = linear(d, d, 0.5)
      if variant == "B":
        state[p + "post_memory_layernorm.weight"] = gain()
        if gated:
          state[p + "post_memory_mlp.gate_proj.weight"] = linear(inter, d)
        state[p + "post_memory_mlp.up_proj.weight"] = linear(inter, d)
        state[p + "post_memory_mlp.down_proj.weight"] = linear(d, inter, 0.5)
  banks = bank_assignments(model_cfg, memory_cfg)
  for b in range(max(banks.values()) + 1 if banks else 0):
    state[f"memory_banks.{b}.base_bank.memory"] = normal((memory_cfg["num_memory_tokens"], r["mem_dim"]), 0.5)
  for m in sorted(mem_layers):
    state[f"routers.{m}.router.weight"] = normal((memory_cfg["num_chapters"], d), 1.0)
    state[f"routers.{m}.router.bias"] = normal((memory_cfg["num_chapters"],), 0.3)
  state["norm.weight"] = gain()
  if model_cfg.get("tie_embeddings", True):
    state["lm_head.weight"] = state["embed_tokens.weight"]
  else:
    state["lm_head.weight"] = normal((v, d), 0.2)
  return state


# ----------------------------------------------------------------------------------------------
# building blocks (float64)


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _softmax(x, axis=-1):
  x = x - np.max(x, axis=axis, keepdims=True)
  e = np.exp(x)
  return e / np.sum(e, axis=axis, keepdims=True)


def _logsumexp(x, axis=-1):
  mx = np.max(x, axis=axis, keepdims=True)
  return np.squeeze(mx, axis) + np.log(np.sum(np.exp(x - mx), axis=axis))


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _linear(x, w):
  """PyTorch nn.Linear without bias: weight is [out, in]."""
  return x @ w.T


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


# MoC-PT MLP's non-gated activations; its gelu is torch's exact (erf) one
_PLAIN = {"silu": _silu, "relu": lambda x: np.maximum(x, 0.0),
          "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
          "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "tanh": np.tanh}


def _mlp(x, s, p, activation):
  """MoC-PT's MLP: SwiGLU, or up -> activation -> down."""
  if activation == "swiglu":
    hidden = _silu(_linear(x, s[p + "gate_proj.weight"])) * _linear(x, s[p + "up_proj.weight"])
  else:
    hidden = _PLAIN[activation](_linear(x, s[p + "up_proj.weight"]))
  return _linear(hidden, s[p + "down_proj.weight"])


def _self_attention(x, s, p, r, attention_mask, use_rope):
  b, l, _ = x.shape
  heads, kv, hd = r["heads"], r["kv"], r["hd"]
  q = _linear(x, s[p + "q_proj.weight"]).reshape(b, l, heads, hd).transpose(0, 2, 1, 3)
  k = _linear(x, s[p + "k_proj.weight"]).reshape(b, l, kv, hd).transpose(0, 2, 1, 3)
  v = _linear(x, s[p + "v_proj.weight"]).reshape(b, l, kv, hd).transpose(0, 2, 1, 3)
  if use_rope:
    freqs = np.outer(np.arange(l, dtype=F64), s[p + "rotary.inv_freq"])
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
  k = np.repeat(k, heads // kv, axis=1)  # repeat_interleave: kv head j serves q heads j*g .. j*g+g-1
  v = np.repeat(v, heads // kv, axis=1)
  scores = q @ k.transpose(0, 1, 3, 2) * hd ** -0.5
  blocked = np.triu(np.ones((l, l), bool), k=1)[None, None]
  if attention_mask is not None:
    blocked = blocked | (np.asarray(attention_mask) == 0)[:, None, None, :]
  scores = np.where(blocked, -np.inf, scores)
  out = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, l, heads * hd)
  return _linear(out, s[p + "o_proj.weight"])


def _router_losses(z, p, idx):
  """MoC-PT `ChapterRouter._compute_losses` over the rows ("samples") of z / p [S, C], idx [S, k]."""
  c = p.shape[-1]
  one_hot = np.zeros((p.shape[0], c))
  if idx.shape[-1]:
    np.put_along_axis(one_hot, idx, 1.0, axis=-1)
  f, big_p = one_hot.mean(0), p.mean(0)  # f: routed selections only (the shared chapters never count)
  return {
      "load_balance": c * np.sum(f * big_p),
      "z_loss": np.mean(_logsumexp(z) ** 2),
      "auxiliary": np.mean((np.mean(p * p, axis=0) - 1.0 / c) ** 2),
  }


def _route(h_in, s, m, mem_cfg):
  """Sequence routing from the layer input; returns chapter ids / mixing weights [B, s+k] and losses."""
  c = mem_cfg["num_chapters"]
  shared = max(0, min(int(mem_cfg.get("num_shared_chapters", 0)), c))
  pooled = h_in.mean(axis=1)  # all positions, pads included
  z = _linear(pooled, s[f"routers.{m}.router.weight"]) + s[f"routers.{m}.router.bias"]
  p = _softmax(z)
  k = min(int(mem_cfg["top_k_chapters"]), c - shared)
  masked = p.copy()
  if shared > 0:
    masked[:, :shared] = 0.0
    masked = masked / masked.sum(-1, keepdims=True)
  idx = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(masked, idx, axis=-1)
  w = w / w.sum(-1, keepdims=True)
  # log-probability gap between the last selected and the first rejected chapter (= router logit gap)
  sorted_p = -np.sort(-masked, axis=-1)
  margin = float(np.min(np.log(sorted_p[:, k - 1] / sorted_p[:, k]))) if k < c - shared else np.inf

  losses = _router_losses(z, p, idx)
  if shared > 0:
    ids = np.concatenate([np.broadcast_to(np.arange(shared), (p.shape[0], shared)), idx], axis=-1)
    raw = np.concatenate([np.ones((p.shape[0], shared)),
                          w * float(mem_cfg.get("routed_scaling_factor", 1.0))], axis=-1)
    weights = raw / raw.sum(-1, keepdims=True)
  else:  # MoC-PT leaves the routed weights alone (no scaling factor) without shared chapters
    ids, weights = idx, w
  return ids, weights, losses, margin


def _memory_tokens(bank, ids, weights, mem_cfg):
  """Gathered chapter rows, parameter-free normalised, each scaled by its chapter's weight."""
  tpc = mem_cfg["num_memory_tokens"] // mem_cfg["num_chapters"]
  rows = ids[:, :, None] * tpc + np.arange(tpc)[None, None, :]
  mem = bank[rows.reshape(ids.shape[0], -1)]  # [B, (s+k)*tpc, mem_dim]
  shared_tokens = max(0, int(mem_cfg.get("num_shared_chapters", 0))) * tpc
  if (mem_cfg.get("normalize_shared_routed_before_mixing", False)
      and 0 < shared_tokens < mem.shape[1]):
    mem = _token_norm(mem, mem_cfg)
  return mem * np.repeat(weights, tpc, axis=-1)[..., None]


def _token_norm(mem, mem_cfg):
  """The parameter-free per-vector shared/routed norm (applied alike to both slices)."""
  eps = float(mem_cfg.get("shared_routed_norm_eps", 1e-6))
  kind = mem_cfg.get("shared_routed_norm_type", "rms")
  if kind == "rms":
    return mem / np.sqrt(np.mean(mem * mem, axis=-1, keepdims=True) + eps)
  if kind == "layernorm":
    mu = mem.mean(-1, keepdims=True)
    var = np.mean((mem - mu) ** 2, axis=-1, keepdims=True)
    return (mem - mu) / np.sqrt(var + eps)
  raise ValueError(f"unknown shared_routed_norm_type {kind!r}")


def _memory_attention(x, mem, s, p, r):
  b, l, _ = x.shape
  n = mem.shape[1]
  heads, kv, hd = r["mem_heads"], r["mem_kv"], r["mem_hd"]
  q = _linear(x, s[p + "q_proj.weight"]).reshape(b, l, heads, hd).transpose(0, 2, 1, 3)
  k = _linear(mem, s[p + "k_proj.weight"]).reshape(b, n, kv, hd).transpose(0, 2, 1, 3)
  v = _linear(mem, s[p + "v_proj.weight"]).reshape(b, n, kv, hd).transpose(0, 2, 1, 3)
  k = np.repeat(k, heads // kv, axis=1)
  v = np.repeat(v, heads // kv, axis=1)
  attn = _softmax(q @ k.transpose(0, 1, 3, 2) * hd ** -0.5)  # one joint softmax, no mask, no RoPE
  out = (attn @ v).transpose(0, 2, 1, 3).reshape(b, l, heads * hd)
  return _linear(out, s[p + "o_proj.weight"])


def _route_token(h_in, s, m, mem_cfg):
  """Token routing (MoC-PT `ChapterRouter.route_token_level`) from the layer input.

  Returns routed chapter ids (global, shared excluded) and their top-k weights, both [B, L, k], the
  router losses over the B*L positions (pads included) and the top-k logit margin.
  """
  b, l, _ = h_in.shape
  c = mem_cfg["num_chapters"]
  shared = max(0, min(int(mem_cfg.get("num_shared_chapters", 0)), c))
  z = _linear(h_in, s[f"routers.{m}.router.weight"]) + s[f"routers.{m}.router.bias"]  # [B, L, C]
  p = _softmax(z)
  k = min(int(mem_cfg["top_k_chapters"]), c - shared)
  if k <= 0:
    ids = np.zeros((b, l, 0), np.int64)
    weights = np.zeros((b, l, 0))
    margin = np.inf
  else:
    routed = p[..., shared:]
    routed = routed / routed.sum(-1, keepdims=True)
    local = np.argsort(-routed, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(routed, local, axis=-1)
    weights = w / w.sum(-1, keepdims=True)
    ids = local + shared
    sorted_p = -np.sort(-routed, axis=-1)
    margin = float(np.min(np.log(sorted_p[..., k - 1] / sorted_p[..., k]))) if k < c - shared else np.inf
  losses = _router_losses(z.reshape(b * l, c), p.reshape(b * l, c), ids.reshape(b * l, -1))
  return ids, weights, losses, margin


def _token_routed_memory_attention(x, bank, ids, weights, s, p, r, mem_cfg):
  """MoC-PT `_forward_token_routed_attention` (weighted, emulated path), then W_o.

  out = Attn(q, shared rows) + routed_scaling_factor * sum_i w_i Attn(q, chapter_i rows): the shared
  chapters form one dense joint softmax, every selected routed chapter its own softmax; the memory
  rows are not multiplied by any weight. The token norm applies to the whole bank when there are
  both shared and routed rows. No attention mask: every position (pads too) reads memory.
  """
  b, l, _ = x.shape
  n = bank.shape[0]
  heads, kv, hd = r["mem_heads"], r["mem_kv"], r["mem_hd"]
  g = heads // kv
  tpc = n // mem_cfg["num_chapters"]
  shared = max(0, min(int(mem_cfg.get("num_shared_chapters", 0)), mem_cfg["num_chapters"]))
  shared_rows = shared * tpc
  mem = bank
  if mem_cfg.get("normalize_shared_routed_before_mixing", False) and 0 < shared_rows < n:
    mem = _token_norm(mem, mem_cfg)
  q = _linear(x, s[p + "q_proj.weight"]).reshape(b, l, heads, hd)
  keys = np.repeat(_linear(mem, s[p + "k_proj.weight"]).reshape(n, kv, hd), g, axis=1)  # [N, H, hd]
  values = np.repeat(_linear(mem, s[p + "v_proj.weight"]).reshape(n, kv, hd), g, axis=1)
  out = np.zeros((b, l, heads, hd))
  if shared_rows > 0:
    attn = _softmax(np.einsum("blhd,nhd->blhn", q, keys[:shared_rows]) * hd ** -0.5)
    out = out + np.einsum("blhn,nhd->blhd", attn, values[:shared_rows])
  if shared_rows < n and ids.shape[-1] > 0 and tpc > 0:
    routed = np.zeros((b, l, heads, hd))
    for i in range(ids.shape[-1]):
      rows = ids[..., i, None] * tpc + np.arange(tpc)  # [B, L, T] global bank rows of chapter i
      attn = _softmax(np.einsum("blhd,blthd->blht", q, keys[rows]) * hd ** -0.5)
      routed = routed + weights[..., i, None, None] * np.einsum("blht,blthd->blhd", attn, values[rows])
    out = out + float(mem_cfg.get("routed_scaling_factor", 1.0)) * routed  # scaled even with no shared chapter
  return _linear(out.reshape(b, l, heads * hd), s[p + "o_proj.weight"])


def next_token_ce(logits, labels):
  """Mean NLL of labels[:, 1:] under logits[:, :-1], ignoring label -100 (F.cross_entropy)."""
  logits = np.asarray(logits, F64)[:, :-1]
  labels = np.asarray(labels)[:, 1:]
  valid = labels != -100
  logp = logits - _logsumexp(logits)[..., None]
  nll = -np.take_along_axis(logp, np.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
  return float(np.sum(nll * valid) / np.sum(valid))


# ----------------------------------------------------------------------------------------------
# forward


def mocpt_forward(model_cfg: dict, memory_cfg: dict, state: dict, input_ids, attention_mask=None,
                  train: bool = False, labels=None, return_info: bool = False):
  """MoC-PT `MemoryTransformer.forward` in float64 -> (logits [B,L,V], ce_loss, aux_loss).

  labels default to input_ids with -100 where attention_mask == 0. aux_loss is the router loss
  MoC-PT adds in train mode (mean over memory layers of the enabled, weighted terms); it is 0.0
  when train is False. The routing strategy is `routing_strategy_train` when train is True, else
  `routing_strategy_inference`. With return_info, a fourth value carries per-memory-layer chapter
  ids, weights, raw losses and the top-k logit margin (how far routing is from a tie): for
  "sequence" ids / weights are [B, s+k] with the shared chapters first and the mixed weights; for
  "token" they are [B, L, k], routed chapters only (global ids) and their top-k weights.
  """
  _check_supported(model_cfg, memory_cfg)
  s = {k: np.asarray(v, F64) for k, v in state.items()}
  r = _resolved(model_cfg, memory_cfg)
  eps = float(model_cfg.get("norm_eps", 1e-6))
  use_rope = model_cfg.get("use_rope", True)
  variant = memory_cfg.get("memory_block_variant", "A")
  input_ids = np.asarray(input_ids)
  if labels is None:
    labels = np.where(np.asarray(attention_mask) == 0, -100, input_ids) if attention_mask is not None \
        else input_ids
  mem_layers = memory_layer_indices(model_cfg, memory_cfg)
  banks = bank_assignments(model_cfg, memory_cfg)

  h = s["embed_tokens.weight"][input_ids]
  strategy = memory_cfg.get("routing_strategy_train" if train else "routing_strategy_inference", "sequence")
  info = {"layers": [], "ids": [], "weights": [], "losses": [], "margin": [], "strategy": strategy}
  for i in range(model_cfg["num_layers"]):
    p = f"layers.{i}."
    mem = None
    if i in mem_layers:
      bank = s[f"memory_banks.{banks[i]}.base_bank.memory"]
      if strategy == "token":
        ids, weights, losses, margin = _route_token(h, s, i, memory_cfg)
        mem = (bank, ids, weights)
      else:
        ids, weights, losses, margin = _route(h, s, i, memory_cfg)
        mem = _memory_tokens(bank, ids, weights, memory_cfg)
      for key, val in zip(("layers", "ids", "weights", "losses", "margin"), (i, ids, weights, losses, margin)):
        info[key].append(val)
    h = h + _self_attention(_rms_norm(h, s[p + "input_layernorm.weight"], eps), s, p + "self_attn.", r,
                            attention_mask, use_rope)

    def memory_step(h):
      x = _rms_norm(h, s[p + "memory_layernorm.weight"], eps)
      if strategy == "token":
        return h + _token_routed_memory_attention(x, *mem, s, p + "memory_attn.", r, memory_cfg)
      return h + _memory_attention(x, mem, s, p + "memory_attn.", r)

    def mlp_step(h, norm="post_attention_layernorm", mlp="mlp"):
      return h + _mlp(_rms_norm(h, s[p + norm + ".weight"], eps), s, p + mlp + ".", _activation(model_cfg))

    if mem is None:
      h = mlp_step(h)
    elif variant == "A":
      h = mlp_step(memory_step(h))
    elif variant == "B":
      h = mlp_step(memory_step(mlp_step(h)), "post_memory_layernorm", "post_memory_mlp")
    else:
      raise ValueError(f"unknown memory_block_variant {variant!r}")

  logits = _linear(_rms_norm(h, s["norm.weight"], eps), s["lm_head.weight"])
  ce = next_token_ce(logits, labels)

  aux = 0.0
  if train and info["losses"]:
    coefs = {
        "load_balance": memory_cfg.get("load_balance_coefficient", 0.01)
        if memory_cfg.get("use_load_balance_loss", True) else 0.0,
        "z_loss": memory_cfg.get("z_loss_coefficient", 0.001) if memory_cfg.get("use_z_loss", False) else 0.0,
        "auxiliary": memory_cfg.get("auxiliary_loss_coefficient", 0.01)
        if memory_cfg.get("use_auxiliary_loss", False) else 0.0,
    }
    per_layer = [sum(coefs[k] * layer[k] for k in coefs if coefs[k] > 0) for layer in info["losses"]]
    aux = float(np.mean(per_layer))
  if return_info:
    return logits, ce, aux, info
  return logits, ce, aux
