"""Analytic FLOPs of a config, counted exactly as MoC-PT's `scripts/estimate_flops.py` (docs/mocpt_semantics.md).

The paper's compute claims (459,171,802,488 forward FLOPs per 1024-token sequence, the "iso-FLOP"
vanilla baseline) are statements about that estimator, so this one reproduces it to the unit (docs/mocpt_semantics.md#published-flops-and-parameter-counts)
instead of counting our own XLA ops. Every count is an exact integer. With sequence routing the memory
terms cover only the tokens actually read, (num_shared + top_k) chapters per sequence, never the bank.

Rules its counting (docs/mocpt_semantics.md#flops-counting-rules) leaves open, fixed by its published numbers:
* top-k costs B·C·max(1, ceil(log2 k)) with k = routed top-k (4097·6 = 24,582 for k = 64);
* every router statistic is counted whatever its loss coefficient: the published numbers count the MSE aux term
  (12,291; off in the paper run) and the entropy (16,388; only ever logged);
* the LB and MSE aux terms reduce over chapters only, so they do not grow with the batch: FLOPs are
  linear in B except for those 2C + 3C per memory layer;
* cross-entropy runs over L−1 positions: 5·1023·49,152 = 251,412,480 (L would give 251,658,240);
* the 7 element-wise FLOPs per score (softmax 5 + mask/scale 2) apply to memory attention too, and
  its QKᵀ+AV width is d_model whatever memory.num_kv_heads / memory.dim: 4·1024·4160·768 =
  13,086,228,480, the value the published memory-attention total 25,674,645,504 implies (the sub-part as published
  prints, 13,086,351,360, is 122,880 off and does not add up to that total).

FFN memory (memory.kind=ffn) counts its fetched columns as MLP columns (`_ffn_extra`). The product-key kinds
(memory.kind pkm, hml) are not MoC-PT's and are counted by the same per-element rules
(`_pkm_extra`, `_hml_extra`): a query's half scores its n sub-keys (a matmul), the top-k search counts as the
product router's, the k chosen slots' scores are computed again from their sub-keys (2*k*dim), and reading k
value rows of width d_v costs 2*k*d_v per query head. Unlike the rest, the search (the `search` nodes: scores,
top-k, candidate sums) has no backward pass and is not recomputed under remat (model/product_keys.py keeps its
result), so the backward and recompute terms leave it out.

`python -m moc_jax.flops --config=configs/moc.py:262k [--batch=B] [--seq_len=L] [--json] [--config.x=y]`
"""
from __future__ import annotations

import dataclasses
import json

from moc_jax.config import bank_ids, chapters_read, memory_layers, router_factors
from moc_jax.model.product_keys import product_candidates

SOFTMAX = 5     # per element: exp, sum, divide, max, subtract
MASK_SCALE = 2  # per attention score, counted for self and memory attention alike
SWIGLU = 5      # per hidden element: SiLU 4 + the gate product 1
# per hidden element of a plain MLP (model.hidden_activation; MoC-PT's scripts/estimate_flops.py ACTIVATION_FLOPS)
PLAIN_ACTIVATION = {"silu": 4, "gelu": 8, "relu": 1, "sigmoid": 4, "tanh": 4}
POOL_WEIGHT = 5  # attention pooling, per position: cap (divide, tanh, multiply), exp, mask
SEARCH = "search"  # a component run forward only, once: no backward, no recompute (the product-key search)


@dataclasses.dataclass(frozen=True)
class Flops:
  """The result of one counting rule; `matmul` selects MoC-PT's matmul or element-wise column."""
  count: int
  matmul: bool = False


# ---- counting rules (MoC-PT's estimate_flops.py), one function each ----

def linear(n, d_in, d_out):
  return Flops(2 * n * d_in * d_out, matmul=True)


def attention_matmuls(b, lq, lk, width):
  """QKᵀ plus AV; `width` is the full query width (d_model), not the KV width."""
  return Flops(4 * b * lq * lk * width, matmul=True)


def score_elementwise(b, heads, lq, lk):
  return Flops((SOFTMAX + MASK_SCALE) * b * heads * lq * lk)


def softmax(n):
  """Softmax (or CE) over `n` elements."""
  return Flops(SOFTMAX * n)


def rms_norm(n, d):
  return Flops(n * (4 * d + 4))


def layer_norm(n, d):
  return Flops(n * (8 * d + 8))


def rope(tokens, q_dim, k_dim):
  return Flops(3 * tokens * (q_dim + k_dim))


def swiglu(tokens, mlp_dim):
  return Flops(SWIGLU * tokens * mlp_dim)


def per_element(n, d):
  """One FLOP per element of n vectors of size d: residual adds, chapter weighting."""
  return Flops(n * d)


def mean_pool(b, l, d):
  """Sequence routing's mean over L positions: L−1 adds and one divide per feature."""
  return Flops(b * d * (l - 1) + b * d)


def top_k(b, c, k):
  return Flops(b * c * max(1, (k - 1).bit_length()))  # bit_length(k−1) = ceil(log2 k) for k >= 1


def router_aux(s, c, k):
  """Router statistics over s samples (sequences) and C chapters, every term counted (see above)."""
  return {
      "f": Flops(s * c * (k - 1) + c * (s - 1) + c),
      "P": Flops(c * (s - 1) + c),
      "load_balance": Flops(c + (c - 1) + 1),
      "p_squared": Flops(s * c + c * (s - 1) + c),
      "mse": Flops(2 * c + (c - 1) + 1),
      "z": Flops(SOFTMAX * s * c + s + (s - 1) + 1),
      "entropy": Flops(4 * s * c),
  }


_TOKEN_NORMS = {"rms": rms_norm, "layernorm": layer_norm}


# ---- components ----

def _attention(b, lq, lk, d, heads, kv_dim, kv_in):
  """Q/O projections on the queries, K/V projections (from `kv_in` features) on the keys, scores."""
  return {"q": linear(b * lq, d, d), "k": linear(b * lk, kv_in, kv_dim), "v": linear(b * lk, kv_in, kv_dim),
          "o": linear(b * lq, d, d), "scores": attention_matmuls(b, lq, lk, d),
          "softmax": score_elementwise(b, heads, lq, lk)}


def _mlp(tokens, d, mlp_dim, activation="swiglu"):
  """SwiGLU: gate, up, down and the gated activation; a plain MLP (model.hidden_activation): up, down, activation."""
  if activation == "swiglu":
    return {"gate": linear(tokens, d, mlp_dim), "up": linear(tokens, d, mlp_dim),
            "down": linear(tokens, mlp_dim, d), "activation": swiglu(tokens, mlp_dim)}
  return {"up": linear(tokens, d, mlp_dim), "down": linear(tokens, mlp_dim, d),
          "activation": Flops(PLAIN_ACTIVATION[activation] * tokens * mlp_dim)}


def _standard_layer(m, b, l):
  t, d = b * l, m.d_model
  kv = m.num_kv_heads * (d // m.num_heads)
  return {"self_attention": _attention(b, l, l, d, m.num_heads, kv, d), "rope": rope(t, d, kv),
          "norms": {"attention": rms_norm(t, d), "mlp": rms_norm(t, d)},
          "mlp": _mlp(t, d, m.mlp_dim, m.hidden_activation),
          "residuals": {"attention": per_element(t, d), "mlp": per_element(t, d)}}


def selected_tokens(c) -> int:
  """Memory tokens each decision reads: its shared plus routed chapters (`config.chapters_read`)."""
  mem = c.memory
  return chapters_read(c) * (mem.num_tokens // mem.num_chapters)


def grid_router_aux(n, s, a, b, routable, k):
  """The product router's statistics over n decisions as the train step computes them, never expanding the C
  logits (`routing.grid_router_losses`; our count): the per-chapter means (the balance term's P and the MSE
  aux's mean squared probability) are one [a, n] x [n, b] matmul each; the rest is per factor, each log-sum-exp
  at the softmax rate per element and each exp-weighted sum at the entropy rate."""
  c = s + routable
  return {
      "f": Flops(n * k + c),
      "P": Flops(2 * n * a * b, matmul=True),
      "P_scale": Flops(n * b + a * b),
      "load_balance": Flops(c + (c - 1) + 1),
      "normaliser": softmax(n * (s + 2 * a + 2 * b)),  # shared, rows, full rows, columns, last row's columns
      "p_squared": Flops(2 * n * a * b, matmul=True),
      # squares of the shared, row, column and routed-mass factors; the column scaling; the divide; the shared mean
      "p_squared_scale": Flops(n * (s + a + b + 1) + n * b + a * b + s * n),
      "mse": Flops(2 * c + (c - 1) + 1),
      "z": Flops(n + (n - 1) + 1),
      "entropy": Flops(4 * n * (s + a + b)),
  }


def _product_search(n, a, b, cells, k):
  """`product_keys.product_top_k` over n queries of an a x b grid's first `cells` cells (our count): the top k of
  the full rows, of the columns and of a partial last row's cells, the row + column sums of those candidates and
  the top k of them, then the chosen values' sums and their softmax."""
  full, kr, kc, partial, kp = product_candidates(a, b, cells, k)
  candidates = kr * kc + kp
  firsts = (top_k(n, full, kr).count + top_k(n, b, kc).count if full else 0) + (
      top_k(n, partial, kp).count if partial else 0)
  return {"top_k": Flops(firsts + top_k(n, candidates, k).count), "candidates": Flops(n * candidates),
          "weights": Flops(n * k + SOFTMAX * n * k)}


def _grid_choice(mem, n, a, b):
  """The product router's top-k over n decisions (`routing.grid_route`; our count): `_product_search`. With the
  aux-free bias the choice expands the grid and takes the top k of every chapter."""
  k = mem.top_k
  if mem.load_balance == "aux_free":
    return {"grid": Flops(n * a * b), "top_k": top_k(n, mem.num_chapters, k),
            "weights": Flops(n * k + SOFTMAX * n * k)}
  return _product_search(n, a, b, mem.num_chapters - mem.num_shared, k)


def _pool_weights(t, d):
  """`memory.routing_pool=attention` over t positions (our count): the parameter-free RMS norm of each input, its
  dot with the query, the capped exponential (divide, tanh, multiply, exp) and the mask, then the weight on each
  input's d elements."""
  return {"pool_norm": rms_norm(t, d), "pool_scores": linear(t, d, 1),
          "pool_weights": Flops(t * (POOL_WEIGHT + d))}


def _router(c, b, l):
  """Router and its statistics. Sequence routing: one decision per row (as MoC-PT counts it). Per-position routing
  (not in MoC-PT's estimator; our count): one decision per position (token, prefix) or per chunk,
  pooled by a cumulative masked sum (prefix, chunk: a sum and a count per position, a divide per
  decision). `memory.router=product` (our count): a linear map to s + a + b logits, then the factored choice and
  statistics the train step runs, whose cost grows with the bank through two [a, n] x [n, b] matmuls, O(C) reductions
  over the step's loads and, with the aux-free bias, the expanded top-k."""
  mem, d = c.memory, c.model.d_model
  if mem.routing == "cluster":  # no router: the chapters come with the batch
    return {}, {}
  if mem.routing == "sequence":
    decisions, pool = b, mean_pool(b, l, d)
  else:
    decisions = b * (l if mem.routing != "chunk" else -(-l // mem.routing_chunk))
    pool = Flops(0) if mem.routing == "token" else Flops(b * l * (d + 1) + decisions * d)
  if mem.routing_pool == "attention":  # our count: each position's score and its weight on the pooled input
    pool = {"pool": pool, **_pool_weights(b * l, d)}
  else:
    pool = {"pool": pool}
  if mem.router == "linear":
    return ({**pool, "linear": linear(decisions, d, mem.num_chapters),
             "softmax": softmax(decisions * mem.num_chapters), "top_k": top_k(decisions, mem.num_chapters, mem.top_k)},
            router_aux(decisions, mem.num_chapters, mem.top_k))
  a, b_ = router_factors(c)
  s, routable = mem.num_shared, mem.num_chapters - mem.num_shared
  return ({**pool, "linear": linear(decisions, d, s + a + b_), **_grid_choice(mem, decisions, a, b_)},
          grid_router_aux(decisions, s, a, b_, routable, mem.top_k))


def _memory_extra(c, b, l):
  """What a memory layer adds to a standard one: router, aux, preprocessing, memory attention,
  its norm and residual; variant B also a norm, a second MLP and a residual.

  Per-position routing normalises and projects the whole bank once per call (shared by the `b`
  rows), then every position attends its own chapters; the chapter weights scale scores and
  probabilities instead of memory tokens. Token routing reads the shared chapters by an attention of their own,
  which normalises and projects their tokens once more for each row."""
  m, mem = c.model, c.memory
  t, d = b * l, m.d_model
  d_mem = mem.dim or d
  kv_dim = mem.num_kv_heads * (d // mem.num_heads)
  normed = mem.token_norm != "none" and mem.num_shared > 0 and mem.top_k > 0  # MoC-PT skips it otherwise
  norm = _TOKEN_NORMS[mem.token_norm] if normed else (lambda n, d: Flops(0))
  router, aux = _router(c, b, l)
  if mem.routing == "sequence":
    n = b * selected_tokens(c)
    preprocessing = {"weighting": per_element(n, d_mem), "token_norm": norm(n, d_mem)}
    attention = _attention(b, l, selected_tokens(c), d, mem.num_heads, kv_dim, d_mem)
  else:
    bank_tokens = mem.num_tokens
    per_score = t * mem.num_heads * selected_tokens(c)
    preprocessing = {"weighting": Flops(2 * per_score if mem.routing != "token"
                                        else per_score * mem.top_k // (mem.num_shared + mem.top_k) + t * d),
                     "token_norm": norm(bank_tokens, d_mem)}
    attention = {"q": linear(t, d, d), "k": linear(bank_tokens, d_mem, kv_dim), "v": linear(bank_tokens, d_mem, kv_dim),
                 "o": linear(t, d, d), "scores": attention_matmuls(b, l, selected_tokens(c), d),
                 "softmax": score_elementwise(b, mem.num_heads, l, selected_tokens(c))}
    if mem.routing == "token" and mem.num_shared:  # the shared chapters' own attention normalises and projects
      shared = b * mem.num_shared * (mem.num_tokens // mem.num_chapters)  # their tokens again, once per row
      preprocessing["shared_token_norm"] = norm(shared, d_mem)
      attention.update(shared_k=linear(shared, d_mem, kv_dim), shared_v=linear(shared, d_mem, kv_dim))
  extra = {
      "router": router,
      "router_aux": aux,
      "preprocessing": preprocessing,
      "attention": attention,
      "norm": rms_norm(t, d),
      "residual": per_element(t, d),
  }
  if mem.block_variant == "B":
    extra.update(post_memory_norm=rms_norm(t, d), post_memory_mlp=_mlp(t, d, m.mlp_dim, m.hidden_activation),
                 post_memory_residual=per_element(t, d))
  return extra


def _product_lookup(c, queries, dim, value_dim):
  """Product keys of `queries` query heads of width `dim` (model/product_keys.py; our count): the optional
  parameter-free norm of each half, each half's scores against its n sub-keys, the search, and the read of the
  k value rows (a multiply and an add per element of each row read)."""
  mem = c.memory
  n, k = mem.pkm_sub_keys, mem.pkm_top_k
  norm = layer_norm(2 * queries, dim // 2) if mem.pkm_query_norm == "layernorm" else Flops(0)
  found = _product_search(queries, n, n, n * n, k)
  weights = found.pop("weights")
  return {"query_norm": norm, SEARCH: {"scores": linear(2 * queries, dim // 2, n), **found},
          "rescore": linear(2 * queries * k, dim // 2, 1), "weights": weights,
          "values": Flops(2 * queries * k * value_dim)}


def _pkm_extra(c, b, l):
  """What a pkm memory read adds to a standard layer (model/pkm.py; our count): its norm, the query, the product
  keys of pkm_heads heads, one bag of their H*k value rows, the gated output and the residual."""
  m, mem = c.model, c.memory
  t, d, heads = b * l, m.d_model, mem.pkm_heads
  value_dim = mem.pkm_value_dim or d
  lookup = _product_lookup(c, t * heads, mem.pkm_key_dim, value_dim)
  extra = {"norm": rms_norm(t, d), "query": linear(t, d, heads * mem.pkm_key_dim), "lookup": lookup}
  if mem.pkm_gated:
    extra["output"] = {"gate": linear(t, d, value_dim), "activation": swiglu(t, value_dim),
                       "out": linear(t, value_dim, d)}
  extra["residual"] = per_element(t, d)
  if mem.block_variant == "B":
    extra.update(post_memory_norm=rms_norm(t, d), post_memory_mlp=_mlp(t, d, m.mlp_dim, m.hidden_activation),
                 post_memory_residual=per_element(t, d))
  return extra


def _hml_extra(c, b, l):
  """What an hml memory block adds before a standard layer (model/hml.py; our count): its norm, self-attention
  without W_o (with RoPE), the product keys of every head on its own output, the value rows, the per-head maps
  W_h and the residual."""
  m = c.model
  t, d, heads = b * l, m.d_model, m.num_heads
  head_dim, kv = d // heads, m.num_kv_heads * (d // heads)
  attention = _attention(b, l, l, d, heads, kv, d)
  del attention["o"]
  return {"norm": rms_norm(t, d), "attention": attention, "rope": rope(t, d, kv),
          "lookup": _product_lookup(c, t * heads, head_dim, head_dim), "maps": linear(t * heads, head_dim, head_dim),
          "residual": per_element(t, d)}


def _ffn_extra(c, b, l):
  """What FFN memory adds to a standard layer (model/ffn_memory.py; our count): every token's fetched columns (the
  shared ones and its path's) widen the MLP: their gate and up products with the MLP's normed input, the SwiGLU
  of each, the down product, and the add into the MLP's output."""
  t, d = b * l, c.model.d_model
  return {"columns": _mlp(t, d, chapters_read(c)), "residual": per_element(t, d)}


_MEMORY_EXTRA = {"chapters": _memory_extra, "pkm": _pkm_extra, "hml": _hml_extra, "ffn": _ffn_extra}


def rows_read(c, l) -> int:
  """Rows of the bank one sequence of `l` tokens reads per memory layer: its shared and routed chapters' tokens
  (sequence routing, MoC-PT's "selected memory tokens"), every token's fetched FFN columns, or every token's
  heads x k value slots."""
  mem = c.memory
  if mem.kind == "chapters":
    return selected_tokens(c)
  if mem.kind == "ffn":
    return l * chapters_read(c)
  return l * (mem.pkm_heads if mem.kind == "pkm" else c.model.num_heads) * mem.pkm_top_k


def _head(m, b, l):
  t = b * l
  return {"final_norm": rms_norm(t, m.d_model), "lm_head": linear(t, m.d_model, m.vocab_size),
          "cross_entropy": softmax(b * (l - 1) * m.vocab_size)}


def _sum(tree, matmul=None) -> int:
  """Total FLOPs of a component tree; only one column if `matmul` is given."""
  return sum(_sum(v, matmul) if isinstance(v, dict) else (v.count if matmul in (None, v.matmul) else 0)
             for v in tree.values())


def _sum_forward_only(tree) -> int:
  """FLOPs of the tree's SEARCH nodes (run forward only, once)."""
  return sum(_sum(v) if k == SEARCH else _sum_forward_only(v) for k, v in tree.items() if isinstance(v, dict))


def _render(tree) -> dict:
  return {"total": _sum(tree), **{k: _render(v) if isinstance(v, dict) else v.count for k, v in tree.items()}}


# ---- public API ----

def estimate(config, batch=1, seq_len=None, *, recompute=True, flash=True, world_size=1, accum=None,
             steps=None) -> dict:
  """FLOPs of `batch` sequences of `seq_len` (default data.seq_len) tokens on one device, MoC-PT's rules.

  recompute: full per-layer activation checkpointing re-runs every layer's forward (the head excluded).
  flash=False: MoC-PT without flash-attn checkpoints memory attention itself, re-running its forward
    up to W_o (memory_gradient_checkpointing, on in every MoC-PT config); the paper assumes flash.
  A step is accum (default train.grad_accum) micro-steps on each of world_size devices; a run is
  steps (default train.steps) steps. Optimizer FLOPs and communication are excluded.
  Returns per-component trees (each node with its "total") and the totals.
  """
  l = config.data.seq_len if seq_len is None else seq_len
  accum = config.train.grad_accum if accum is None else accum
  steps = config.train.steps if steps is None else steps
  mem_layers = memory_layers(config)
  n_mem, n_std = len(mem_layers), config.model.num_layers - len(mem_layers)
  std = _standard_layer(config.model, batch, l)
  mem_layer = {"backbone": std, "memory": _MEMORY_EXTRA[config.memory.kind](config, batch, l)} if n_mem else {}
  head = _head(config.model, batch, l)

  def weighted(matmul=None):
    return n_std * _sum(std, matmul) + n_mem * _sum(mem_layer, matmul)

  layers = weighted()
  forward = layers + _sum(head)
  matmul = weighted(True) + _sum(head, True)
  forward_only = n_mem * _sum_forward_only(mem_layer) if n_mem else 0
  recompute_layers = layers - forward_only if recompute else 0
  recompute_memory = 0
  if n_mem and not flash and config.memory.kind == "chapters":  # memory attention up to W_o, once more per layer
    attention = mem_layer["memory"]["attention"]
    recompute_memory = n_mem * (_sum(attention) - attention["o"].count)
  backward = 2 * (forward - forward_only)
  micro = forward + backward + recompute_layers + recompute_memory
  return {
      "batch": batch, "seq_len": l,
      "layers": {"standard": n_std, "memory": list(mem_layers), "banks": len(set(bank_ids(config)))},
      "selected_memory_tokens": rows_read(config, l) if n_mem else 0,
      "standard_layer": _render(std),
      "memory_layer": _render(mem_layer) if n_mem else None,
      "head": _render(head),
      "forward": {"total": forward, "matmul": matmul, "elementwise": forward - matmul, "layers": layers,
                  "head": _sum(head)},
      "backward": backward,
      "recompute": {"total": recompute_layers + recompute_memory, "layers": recompute_layers,
                    "memory_attention": recompute_memory},
      "train": {"micro_step": micro, "step": micro * accum * world_size, "run": micro * accum * world_size * steps,
                "accum": accum, "world_size": world_size, "steps": steps},
  }


def model_flops_per_token(config, seq_len=None) -> float:
  """Training FLOPs per token for MFU: forward + backward, no recompute, over the tokens.

  Memory counts only the chapters (or value slots) read, so MFU reflects the work the model needs, not the bank
  size. Sequence routing and product keys: one sequence. Per-position routing projects the bank once per
  micro-batch, so that projection is shared by the micro-batch's `train.batch_size` sequences.
  """
  shared_projection = memory_layers(config) and config.memory.kind == "chapters" and config.memory.routing != "sequence"
  batch = config.train.batch_size if shared_projection else 1
  e = estimate(config, batch, seq_len, recompute=False)
  return e["train"]["micro_step"] / (e["seq_len"] * batch)


def _table(e, config, per_token) -> str:
  rows = []

  def walk(name, node, depth):
    if not isinstance(node, dict):
      rows.append((depth, name, node))
      return
    rows.append((depth, name, node["total"]))
    for k, v in node.items():
      if k == "backbone":  # a memory layer's standard part, itemised above
        rows.append((depth + 1, "backbone (= standard layer)", v["total"]))
      elif k != "total":
        walk(k, v, depth + 1)

  lay = e["layers"]
  walk(f"standard layer (x{lay['standard']})", e["standard_layer"], 0)
  if lay["memory"]:
    walk(f"memory layer (x{len(lay['memory'])}: layers {lay['memory']})", e["memory_layer"], 0)
  walk("head", e["head"], 0)
  f, r, t = e["forward"], e["recompute"], e["train"]
  rows += [(0, "forward", f["total"]), (1, "matmul", f["matmul"]), (1, "element-wise", f["elementwise"]),
           (0, "backward (2 x forward, search excluded)", e["backward"]), (0, "recompute", r["total"]),
           (1, "layers", r["layers"]), (1, "memory attention (no flash)", r["memory_attention"]),
           (0, "train / micro-step", t["micro_step"]),
           (0, f"train / step (x{t['accum']} accum, x{t['world_size']} devices)", t["step"]),
           (0, f"train / run (x{t['steps']} steps)", t["run"])]
  read = {"chapters": "memory tokens", "ffn": "FFN memory columns"}.get(config.memory.kind,
                                                                       f"{config.memory.kind} value rows")
  lines = [f"{config.name}: batch {e['batch']} x {e['seq_len']} tokens; {lay['banks']} bank(s); "
           f"{e['selected_memory_tokens']:,} {read} read per sequence"]
  lines += [f"{'  ' * d + n:<48}{v:>28,}" for d, n, v in rows]
  lines.append(f"{'model FLOPs per token (fwd + bwd, for MFU)':<48}{per_token:>28,.1f}")
  return "\n".join(lines)


def main(argv):
  from absl import flags
  from moc_jax import cli
  from moc_jax.config import validate
  from moc_jax.errors import UsageError
  cli.quiet_libraries()  # JAX backend probing chatter off the console
  f = flags.FLAGS
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}")
  if f.config is None:
    raise UsageError("--config=PATH.py:ARG is required, e.g. configs/moc.py:262k")
  validate(f.config)
  e = estimate(f.config, f.config.train.batch_size if f.batch is None else f.batch, f.seq_len,
               recompute=f.recompute, flash=f.flash, world_size=f.world_size, accum=f.accum, steps=f.steps)
  print(json.dumps(e) if f.json else _table(e, f.config, model_flops_per_token(f.config, e["seq_len"])))


def _define_flags():
  from absl import flags
  from moc_jax import cli
  cli.define_config_file_flag("Config file and argument, e.g. configs/moc.py:262k.")
  flags.DEFINE_integer("batch", None, "Sequences per micro-step (default train.batch_size; 1 = MoC-PT's table).")
  flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default data.seq_len).")
  flags.DEFINE_bool("recompute", True, "Count per-layer activation checkpointing.")
  flags.DEFINE_bool("flash", True, "Assume flash attention (False adds memory-attention recompute).")
  flags.DEFINE_integer("world_size", 1, "Devices per step (train.batch_size is already global).")
  flags.DEFINE_integer("accum", None, "Micro-steps per step (default train.grad_accum).")
  flags.DEFINE_integer("steps", None, "Steps per run (default train.steps).")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")


if __name__ == "__main__":
  from moc_jax import cli
  _define_flags()
  cli.run(main)
