"""Analytic FLOPs and HBM bytes of one memory-layer read, and its roofline time on TPU v5p and H100.

`python -m kernels_pallas.routed_chapter_attention.roofline [--tokens 8192 --slots 65 --shared 1
  --chapters 4097 --chapter_tokens 64 --heads 12 --kv_heads 12 --head_dim 64 --block_pairs 128
  --gpu_block_pairs 64 --xla_block_pairs 32 --xla_chunk_tiles 0 --dtype bfloat16 --combine joint
  --tiles expected] [--table [--stages pallas_tpu,...]]`
prints one JSON line (and with --table markdown tables: every variant; --stages: per-stage breakdowns).
Defaults: configs/moc.py:262k's memory layer with 8 x 1024 tokens in one call (one device, whole bank),
joint combine (prefix / chunk routing).

Variants (N tokens, S slots, P = N*S pairs, chapter K+V of all kv heads = 2*T*Hkv*dh elements):
  naive       reference.py: K/V gathered per (token, slot), [N, S, T, Hkv, dh], then plain softmax.
  xla         xla.py: the same plan at `--xla_block_pairs` rows per tile; each tile gathers its chapter's
              K/V once (P/tiles pairs per gather), its q rows and (backward) dout rows per row, and the
              chunks of `--xla_chunk_tiles` tiles scatter-add outputs / dq per pair and dK/dV per tile into
              float32 accumulators; joint runs a first pass for the rows' log-sum-exp. Every tile of the
              static bound runs, padded to whole chunks, whatever the routing. A chunk's own float32
              buffers are not counted as HBM traffic (see `_xla`).
  pallas_tpu  pallas_tpu.py: pairs sorted by chapter into tiles of `block_pairs` rows; each kv head
              fetches a chapter's K/V once per run of its consecutive tiles (Hkv * used chapters
              fetches); q rows gathered per pair; per-pair float32 o and lse written, re-read by the merge.
  pallas_gpu  pallas_gpu.py: same plan; program (head, tile) loads its chapter's K/V itself (tiles * H
              loads, counted as HBM traffic although L2 may serve repeats); backward split into a dq kernel
              over tiles and a dK/dV kernel over chapters (row data read by both).
  sequence    MoC-PT's mode for comparison, idealised: per row of L tokens its S chapters are gathered,
              normalised and projected, and the row's K/V is read once by a flash-style attention.
The per-position variants (naive, xla, pallas_*) also normalise and project the whole bank once per call,
4*C*T*d_mem*kv_dim FLOPs, shared by the call's N tokens (amortised per token below).

Counting rules. FLOPs are matmul FLOPs (2 per multiply-add), executed ones: padding rows of a tile count.
Exponentials (S*T*H per token forward) and the other element-wise work are left out. Bytes are HBM
traffic of each stage (one XLA op group or kernel): operands read once, results written once, no reuse
across stages; gathers read each gathered element. The q projection and W_o are common to all variants
and left out. The sort in the plan is counted as one pass over int32 keys (XLA's sort makes several).
Tiles: `--tiles expected` = expected tile count under uniform routing (each decision picks `top_k`
distinct routed chapters uniformly; `--tokens_per_decision` tokens share a decision, e.g. 64 for chunk
routing), `--tiles bound` = dispatch.num_tiles_bound, the static worst case (every row buffer is sized
by it, whatever the routing; xla runs all its tiles either way). Roofline time of a stage =
max(FLOPs / peak, bytes / bandwidth); a variant's time is the sum over its stages, and its bound is the one
of the stages holding most of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from kernels_pallas.routed_chapter_attention import contract, dispatch, pallas, xla

DEVICES = {  # name -> (bf16 dense FLOP/s, HBM bytes/s)
    "tpu_v5p": (459e12, 2.76e12),
    "h100_sxm": (989e12, 3.35e12),
}
VARIANTS = ("naive", "xla", "pallas_tpu", "pallas_gpu", "sequence")
VARIANT_DEVICES = {"pallas_tpu": ("tpu_v5p",), "pallas_gpu": ("h100_sxm",)}  # the rest: both
F32 = 4


@dataclasses.dataclass(frozen=True)
class Shape:
  tokens: int = 8192
  slots: int = 65
  shared: int = 1
  chapters: int = 4097
  chapter_tokens: int = 64
  heads: int = 12
  kv_heads: int = 12
  head_dim: int = 64
  mem_dim: int = 0          # 0: heads * head_dim (memory.dim = None -> d_model)
  seq_len: int = 1024       # sequence routing: tokens per row
  block_pairs: int = pallas.DEFAULT_BLOCK_PAIRS["tpu"]
  gpu_block_pairs: int = pallas.DEFAULT_BLOCK_PAIRS["gpu"]
  xla_block_pairs: int = xla.DEFAULT_BLOCK_PAIRS
  xla_chunk_tiles: int = 0  # 0: the default of xla.chunk_tiles_for
  dtype_bytes: int = 2      # q, K, V, matmul operands
  param_bytes: int = 4      # the bank parameter
  combine: str = "joint"
  tokens_per_decision: int = 1
  tiles: str = "expected"   # expected | bound

  @property
  def pairs(self):
    return self.tokens * self.slots

  @property
  def d_mem(self):
    return self.mem_dim or self.heads * self.head_dim

  @property
  def kv_dim(self):
    return self.kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Plan:
  """The tile plan's sizes: tiles run by the kernels, the static bound, row-buffer rows, chapters in use."""
  block_pairs: int
  tiles: float
  tiles_bound: int
  rows: int
  used: float


def _binomial_pmf(n, p):
  logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
          + (n - i) * math.log1p(-p) for i in range(n + 1)]
  return [math.exp(x) for x in logs]


def expected_tiles(tokens, shared, top_k, chapters, block_pairs, tokens_per_decision=1):
  """(expected tiles, expected chapters in use) when each decision picks `top_k` distinct routed chapters
  uniformly out of `chapters - shared`, every token reads the `shared` chapters, and `tokens_per_decision`
  consecutive tokens share one decision (so a routed chapter's pair count is m * Binomial(N/m, k/(C-s)))."""
  routed = chapters - shared
  shared_tiles = shared * -(-tokens // block_pairs)
  if top_k == 0 or routed == 0:
    return float(shared_tiles), float(shared if tokens else 0)
  m = tokens_per_decision
  decisions, p = -(-tokens // m), top_k / routed
  pmf = _binomial_pmf(decisions, min(p, 1.0)) if p < 1 else [0.0] * decisions + [1.0]
  tiles = sum(q * -(-i * m // block_pairs) for i, q in enumerate(pmf))
  return shared_tiles + routed * tiles, shared + routed * (1 - pmf[0])


def plan_sizes(s: Shape, block_pairs: int) -> Plan:
  bound = dispatch.num_tiles_bound(s.pairs, s.chapters, block_pairs)
  if s.tiles == "bound":
    tiles, used = bound, min(s.chapters, s.pairs)
  else:
    tiles, used = expected_tiles(s.tokens, s.shared, s.slots - s.shared, s.chapters, block_pairs,
                                 s.tokens_per_decision)
  return Plan(block_pairs, tiles, bound, bound * block_pairs, used)


def _stage(flops=0.0, bytes=0.0):  # noqa: A002
  return {"flops": float(flops), "bytes": float(bytes)}


def _plan_stage(s: Shape, plan: Plan):
  """dispatch.make_plan: about a dozen int32 passes over pairs and rows."""
  return _stage(0, 4 * (12 * s.pairs + 2 * plan.rows))


def _to_rows(s: Shape, rows, width, nbytes):
  """Per-pair (or per-token) data gathered for P pairs and written to `rows` rows."""
  return (s.pairs + rows) * width * nbytes


# ---- the Pallas kernels' own traffic (checked against an enumeration of the grid in tests) ----

def pallas_tpu_kernel(s: Shape, plan: Plan, backward: bool):
  """Bytes (by operand) and FLOPs of the TPU kernel. Grid (Hkv, tiles run), tile axis inner: a block is
  copied when its index differs from the previous grid step's, so row blocks move every step, column
  blocks ([R, 1]) once per kv head and tile, K/V once per kv head and chapter run, dK/dV written once per
  kv head and run."""
  b, h, hkv, dh, t = s.dtype_bytes, s.heads, s.kv_heads, s.head_dim, s.chapter_tokens
  rows = plan.tiles * plan.block_pairs
  moe = s.combine == "moe"
  kv = plan.used * 2 * t * s.kv_dim * b
  if not backward:
    traffic = {"ls": hkv * rows * F32, "q": rows * h * dh * b, "kv": kv, "o": rows * h * dh * F32,
               "lse": rows * h * F32}
    return traffic, 4.0 * rows * h * t * dh
  traffic = {"ls_vs": 2 * hkv * rows * F32, "q_do": 2 * rows * h * dh * b, "kv": kv,
             "lse_d": (1 if moe else 2) * rows * h * F32, "dq": rows * h * dh * F32,
             "dls_dvs": 2 * hkv * rows * F32, "dkv": plan.used * 2 * t * s.kv_dim * F32}
  return traffic, (12.0 if moe else 10.0) * rows * h * t * dh


def pallas_gpu_kernel(s: Shape, plan: Plan, backward: bool):
  """Bytes (by operand) and FLOPs of the GPU kernels: forward / dq over programs (head, tile) of the tiles
  run, each loading its rows and its chapter's [T, dh] K and V; dK/dV over programs (kv head, chapter in
  use), each loading K/V once and every row of its run for each of its G query heads."""
  b, h, hkv, dh, t = s.dtype_bytes, s.heads, s.kv_heads, s.head_dim, s.chapter_tokens
  rows = plan.tiles * plan.block_pairs
  moe = s.combine == "moe"
  per_head_kv = plan.tiles * h * 2 * t * dh * b
  if not backward:
    traffic = {"ls": h * rows * F32, "q": rows * h * dh * b, "kv": per_head_kv, "o": rows * h * dh * F32,
               "lse": rows * h * F32}
    return traffic, 4.0 * rows * h * t * dh
  stats = (1 if moe else 2) * rows * h * F32
  traffic = {  # dq kernel, then the dK/dV kernel
      "dq:ls_vs": 2 * h * rows * F32, "dq:q_do": 2 * rows * h * dh * b, "dq:kv": per_head_kv, "dq:lse_d": stats,
      "dq:dq": rows * h * dh * F32, "dq:dls_dvs": 2 * h * rows * F32,
      "dkv:ls_vs": 2 * hkv * rows * F32, "dkv:q_do": 2 * rows * h * dh * b, "dkv:lse_d": stats,
      "dkv:kv": plan.used * 2 * t * s.kv_dim * b, "dkv:dkv": plan.used * 2 * t * s.kv_dim * F32}
  return traffic, ((8.0 if moe else 6.0) + (10.0 if moe else 8.0)) * rows * h * t * dh


# ---- stages of each variant: {name: {"flops", "bytes"}} per call, forward and backward ----

def _bank_projection(s: Shape):
  bank, kv_bank = s.chapters * s.chapter_tokens * s.d_mem, s.chapters * s.chapter_tokens * s.kv_dim
  b, pb = s.dtype_bytes, s.param_bytes
  fwd = {"bank_norm": _stage(0, bank * (pb + b)),  # read the bank, write it normalised
         "bank_kv_projection": _stage(4 * bank * s.kv_dim, bank * b + 2 * kv_bank * b)}
  bwd = {"bank_kv_projection": _stage(8 * bank * s.kv_dim, 2 * 2 * kv_bank * b + bank * b + bank * F32),
         "bank_norm": _stage(0, bank * (2 * pb + F32))}  # read bank and dX, write dbank
  return fwd, bwd


def _naive(s: Shape):
  b, n, p, h, dh, t = s.dtype_bytes, s.tokens, s.pairs, s.heads, s.head_dim, s.chapter_tokens
  kv_pair = 2 * t * s.kv_dim * b  # one chapter's K and V
  mm = 2 * p * t * h * dh
  scores = p * t * h * F32
  fwd = {"gather_kv": _stage(0, 2 * p * kv_pair),
         "scores": _stage(mm, n * h * dh * b + p * kv_pair / 2 + scores),
         "softmax": _stage(0, 2 * scores),
         "pv": _stage(mm, scores + p * kv_pair / 2 + n * h * dh * F32)}
  bwd = {"dprobs": _stage(mm, n * h * dh * F32 + p * kv_pair / 2 + scores),
         "softmax": _stage(0, 3 * scores),
         "dq_dk_dv": _stage(3 * mm, 3 * scores + p * kv_pair / 2 + n * h * dh * (b + 2 * F32)
                            + 2 * p * t * s.kv_dim * F32),
         "scatter_add_dkv": _stage(0, 3 * 2 * p * t * s.kv_dim * F32)}
  return fwd, bwd, {"largest_buffer_bytes": p * kv_pair, "kv_fetches": p, "pairs_per_kv_fetch": 1.0}


def _xla(s: Shape):
  """xla.py's stages. Its scans have static lengths: all tiles of the bound run, padded to whole chunks.
  HBM traffic is what crosses a chunk: the scan's per-chunk inputs and outputs, the gathers (q rows in the
  input dtype, dout rows in float32 as the cotangent of the float32 output, one chapter's K/V per tile,
  consecutive tiles of a chapter not deduplicated) and the scatter-adds into float32 accumulators, which
  read and write each updated row (per pair into the token accumulators, padding rows being dropped; per
  tile into dK/dV). A chunk's own float32 buffers (gathered rows and tiles, scores, probabilities; 0.5 to
  1 MB each at the 262k shape) are not counted: xla.CHUNK_BYTES sizes them to stay in a cache (a CPU core's
  L2, H100's 50 MB L2) and every chunk reuses them; spilled, each would add a write and a read. The matmuls
  run in float32 (HIGHEST) but are timed at the bf16 peak, like every variant's."""
  b, n, p, h, dh, t = s.dtype_bytes, s.tokens, s.pairs, s.heads, s.head_dim, s.chapter_tokens
  plan = plan_sizes(s, s.xla_block_pairs)
  chunk = xla.chunk_tiles_for(plan.tiles_bound, h, plan.block_pairs, t, dh, s.xla_chunk_tiles)
  tiles = -(-plan.tiles_bound // chunk) * chunk
  rows = tiles * plan.block_pairs
  joint = s.combine == "joint"
  kv_tiles = tiles * t * s.kv_dim  # elements of one K (or V) gathered per tile
  kv_bank = s.chapters * t * s.kv_dim
  acc, row_stat = n * h * dh * F32, rows * h * F32  # a token accumulator; one float32 per row and head
  scan_in = lambda scales: 4 * (tiles + rows + scales * rows)  # noqa: E731  chapter, token, row scales
  q_rows = rows * h * dh * b
  scatter_tokens = 2 * p * h * dh * F32
  fwd = {"plan": _plan_stage(s, plan),
         "rows": _stage(0, 2 * _to_rows(s, rows, 1, F32) + 4 * (rows + tiles)),  # scales; token, chapter
         "zeros": _stage(0, acc)}
  if joint:  # pass 1 stacks each row's max and sum; the merge gathers them per pair, and LSE back to rows
    fwd["lse_pass"] = _stage(2 * rows * h * t * dh, scan_in(1) + q_rows + kv_tiles * b + 2 * row_stat)
    fwd["merge"] = _stage(0, 2 * p * h * F32 + 2 * p * 4 + n * h * F32 + (plan.rows + rows) * h * F32)
  # row_stat: joint reads each row's token LSE, moe stacks each row's log-sum-exp
  fwd["output_pass"] = _stage(4 * rows * h * t * dh, scan_in(2) + row_stat + q_rows + 2 * kv_tiles * b
                              + scatter_tokens)
  bwd = {}
  if joint:  # D = dout.out - dlse, then [LSE, D] to rows
    bwd["prologue"] = _stage(0, 2 * acc + 2 * n * h * F32 + 2 * (plan.rows + rows) * h * F32)
  bwd["zeros"] = _stage(0, acc + 2 * kv_bank * F32)
  # stats: joint's [LSE, D] or moe's row log-sum-exp in; d logit_scale, d value_scale per row out
  bwd["grad_pass"] = _stage(10 * rows * h * t * dh, scan_in(2) + (2 if joint else 1) * row_stat + q_rows
                            + rows * h * dh * F32 + 2 * kv_tiles * b + scatter_tokens + 2 * 2 * kv_tiles * F32
                            + 2 * rows * F32)
  # dq and dK/dV cast; d logit_scale and d value_scale gathered back to pairs
  bwd["epilogue"] = _stage(0, n * h * dh * (F32 + b) + 2 * kv_bank * (F32 + b) + 4 * p * F32)
  return fwd, bwd, {"largest_buffer_bytes": max(acc, (2 if joint else 1) * row_stat), "kv_fetches": tiles,
                    "pairs_per_kv_fetch": p / tiles, "block_pairs": plan.block_pairs, "chunk_tiles": chunk,
                    "tiles_run": tiles, "plan": dataclasses.asdict(plan), "rows_per_pair": rows / p}


def _pallas(s: Shape, backend: str):
  b, n, p, h, dh = s.dtype_bytes, s.tokens, s.pairs, s.heads, s.head_dim
  kv_bank = s.chapters * s.chapter_tokens * s.kv_dim
  plan = plan_sizes(s, s.block_pairs if backend == "tpu" else s.gpu_block_pairs)
  r = plan.rows
  kernel = pallas_tpu_kernel if backend == "tpu" else pallas_gpu_kernel
  fwd_traffic, fwd_flops = kernel(s, plan, backward=False)
  bwd_traffic, bwd_flops = kernel(s, plan, backward=True)
  to_rows = lambda width, nbytes: _to_rows(s, r, width, nbytes)  # noqa: E731
  moe = s.combine == "moe"
  # to_rows: q and logit_scale into row order.
  # merge: o pairs gathered from the rows (read + write) and read by the weighted sum, lse pairs read,
  # out written and transposed, LSE written.
  fwd = {"plan": _plan_stage(s, plan),
         "to_rows": _stage(0, to_rows(h * dh, b) + to_rows(1, F32)),
         "kernel": _stage(fwd_flops, sum(fwd_traffic.values())),
         "merge": _stage(0, 3 * p * h * dh * F32 + p * h * F32 + 3 * n * h * dh * F32 + n * h * F32)}
  # prologue: D = dout.out and dout cast. to_rows: q, dout (and joint's LSE, D), both scales.
  # epilogue: dq pairs gathered and summed over slots, dls/dvs summed over heads and gathered, dK/dV cast.
  bwd = {"prologue": _stage(0, 3 * n * h * dh * F32 + n * h * (F32 + dh * b)),
         "to_rows": _stage(0, 2 * to_rows(h * dh, b) + (0 if moe else 2) * to_rows(h, F32) + 2 * to_rows(1, F32)),
         "dkv_zeros": _stage(0, 2 * kv_bank * F32),
         "kernel": _stage(bwd_flops, sum(bwd_traffic.values())),
         "epilogue": _stage(0, 3 * p * h * dh * F32 + n * h * dh * b + 2 * (s.kv_heads if backend == "tpu" else h)
                            * r * F32 + 2 * r * F32 + 4 * p * F32 + 2 * kv_bank * (F32 + b))}
  if backend == "tpu":  # K/V to [C, Hkv, T, dh] in both passes, dK/dV back
    fwd["kv_transpose"] = _stage(0, 2 * 2 * kv_bank * b)
    bwd["kv_transpose"] = _stage(0, 2 * 2 * kv_bank * b)  # dK/dV's transpose back fuses with the cast
  fetches = plan.used * s.kv_heads if backend == "tpu" else plan.tiles * h
  extra = {"largest_buffer_bytes": r * h * dh * F32, "kv_fetches": fetches, "tiles_run": plan.tiles,
           "pairs_per_kv_fetch": p * (s.kv_heads if backend == "tpu" else h) / fetches,
           "plan": dataclasses.asdict(plan), "rows_per_pair": r / p,
           "kernel_bytes": {"forward": fwd_traffic, "backward": bwd_traffic}}
  if backend == "gpu":  # the shared chapter's tiles run serially in one dK/dV program per kv head
    extra["dkv_serial_tiles"] = -(-n // s.gpu_block_pairs) if s.shared else None
  return fwd, bwd, extra


def _sequence(s: Shape):
  b, pb, h, dh, t, l = s.dtype_bytes, s.param_bytes, s.heads, s.head_dim, s.chapter_tokens, s.seq_len
  rows = s.tokens / l
  sel, kv = s.slots * t * s.d_mem, s.slots * t * s.kv_dim  # per row: selected tokens, their K (or V)
  att = 4 * l * s.slots * t * h * dh
  fwd = {"gather_norm": _stage(0, rows * sel * (3 * pb + b)),
         "kv_projection": _stage(rows * 4 * sel * s.kv_dim, rows * (sel * b + 2 * kv * b)),
         "attention": _stage(rows * att, rows * (2 * l * h * dh * b + 2 * kv * b))}
  bwd = {"attention": _stage(rows * att * 10 / 4, rows * (4 * l * h * dh * b + l * h * F32 + 2 * kv * b
                                                           + 2 * kv * F32)),
         "kv_projection": _stage(rows * 8 * sel * s.kv_dim, rows * (4 * kv * F32 + sel * b + sel * F32)),
         "norm_gather": _stage(0, rows * sel * (2 * F32 + pb + 3 * F32))}
  return fwd, bwd, {"largest_buffer_bytes": rows * 2 * kv * b, "kv_fetches": rows * s.slots * s.kv_heads,
                    "pairs_per_kv_fetch": l}


def _roofline(stages, device):
  peak, bw = DEVICES[device]
  times = {k: (max(v["flops"] / peak, v["bytes"] / bw), v["flops"] / peak >= v["bytes"] / bw)
           for k, v in stages.items()}
  total = sum(t for t, _ in times.values())
  compute = sum(t for t, c in times.values() if c)
  return {"ms": 1e3 * total, "bound": "compute" if compute >= total / 2 else "memory",
          "memory_bound_share": 1 - compute / total if total else 0.0}


def _totals(stages, n):
  flops, nbytes = sum(v["flops"] for v in stages.values()), sum(v["bytes"] for v in stages.values())
  return {"flops_per_token": flops / n, "bytes_per_token": nbytes / n,
          "intensity": flops / nbytes if nbytes else math.inf}


def analyse(s: Shape) -> dict:
  """Every variant's forward and backward stages, totals per token and roofline times per layer call."""
  proj_fwd, proj_bwd = _bank_projection(s)
  builders = {"naive": lambda: _naive(s), "xla": lambda: _xla(s), "pallas_tpu": lambda: _pallas(s, "tpu"),
              "pallas_gpu": lambda: _pallas(s, "gpu"), "sequence": lambda: _sequence(s)}
  out = {}
  for name in VARIANTS:
    fwd, bwd, extra = builders[name]()
    if name != "sequence":
      fwd, bwd = {**proj_fwd, **fwd}, {**proj_bwd, **bwd}
    both = {**{"fwd:" + k: v for k, v in fwd.items()}, **{"bwd:" + k: v for k, v in bwd.items()}}
    out[name] = {
        "forward": {**_totals(fwd, s.tokens), "stages_per_token": _per_token(fwd, s.tokens)},
        "backward": {**_totals(bwd, s.tokens), "stages_per_token": _per_token(bwd, s.tokens)},
        "forward_backward": _totals(both, s.tokens),
        "roofline": {d: {"forward": _roofline(fwd, d), "forward_backward": _roofline(both, d)}
                     for d in VARIANT_DEVICES.get(name, tuple(DEVICES))},
        **extra}
  return {"name": "rca_roofline", "shape": dataclasses.asdict(s),
          "devices": {d: {"flops_per_s": f, "bytes_per_s": bw, "ridge_flops_per_byte": f / bw}
                      for d, (f, bw) in DEVICES.items()},
          "attention_flops_per_token_fwd": 4 * s.slots * s.chapter_tokens * s.heads * s.head_dim,
          "bank_projection_flops_per_token_fwd": 4 * s.chapters * s.chapter_tokens * s.d_mem * s.kv_dim / s.tokens,
          "exp_per_token_fwd": s.slots * s.chapter_tokens * s.heads,
          "variants": out}


def _per_token(stages, n):
  return {k: {"flops": v["flops"] / n, "bytes": v["bytes"] / n} for k, v in stages.items()}


def _fmt(x, unit=""):
  for scale, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g}{suffix}{unit}"
  return f"{x:.3g} {unit}".rstrip()


def table(result) -> str:
  """Every variant's totals and roofline times, then the devices' ridge points and the tile plans."""
  lines = ["| variant | pass | FLOPs / token | HBM bytes / token | FLOP/B | pairs per K/V fetch | largest buffer | "
           "TPU v5p ms (bound) | H100 ms (bound) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, v in result["variants"].items():
    for key, label in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
      tot, cells = v[key], []
      for d in DEVICES:
        r = v["roofline"].get(d, {}).get(key)
        cells.append(f"{r['ms']:.3g} ({r['bound']})" if r else "–")
      lines.append(f"| {name} | {label} | {_fmt(tot['flops_per_token'])} | {_fmt(tot['bytes_per_token'], 'B')} | "
                   f"{tot['intensity']:.3g} | {v['pairs_per_kv_fetch']:.4g} | {_fmt(v['largest_buffer_bytes'], 'B')} | "
                   f"{cells[0]} | {cells[1]} |")
  ridges = ", ".join(f"{d} {x['ridge_flops_per_byte']:.3g} FLOP/B" for d, x in result["devices"].items())
  lines += ["", f"Ridge points: {ridges}.", "",
            "| plan | block_pairs | tiles run | tile bound | row-buffer rows / pair | chapters in use | K/V fetches |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for name in ("xla", "pallas_tpu", "pallas_gpu"):
    v = result["variants"][name]
    plan = v["plan"]
    lines.append(f"| {name} | {plan['block_pairs']} | {v['tiles_run']:,.1f} | {plan['tiles_bound']:,} | "
                 f"{v['rows_per_pair']:.3g} | {plan['used']:,.1f} | {v['kv_fetches']:,.0f} |")
  return "\n".join(lines)


def stage_table(result, variant) -> str:
  """One variant's stages (and a Pallas kernel's operands): FLOPs and bytes per token, forward then backward."""
  v, n = result["variants"][variant], result["shape"]["tokens"]
  lines = [f"| {variant} stage | FLOPs / token | HBM bytes / token |", "| --- | --- | --- |"]
  for key, label in (("forward", "fwd"), ("backward", "bwd")):
    for name, st in v[key]["stages_per_token"].items():
      lines.append(f"| {label} {name} | {_fmt(st['flops'])} | {_fmt(st['bytes'], 'B')} |")
      if name == "kernel" and "kernel_bytes" in v:
        for operand, nbytes in v["kernel_bytes"][key].items():
          lines.append(f"| &nbsp;&nbsp;{label} kernel {operand} | | {_fmt(nbytes / n, 'B')} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  defaults = Shape()
  for field in dataclasses.fields(Shape):
    if field.name in ("dtype_bytes", "param_bytes", "combine", "tiles"):
      continue
    parser.add_argument(f"--{field.name}", type=int, default=getattr(defaults, field.name))
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--param_dtype", default="float32", choices=("bfloat16", "float32"))
  parser.add_argument("--combine", default="joint", choices=contract.COMBINES)
  parser.add_argument("--tiles", default="expected", choices=("expected", "bound"))
  parser.add_argument("--table", action="store_true", help="also print a markdown table")
  parser.add_argument("--stages", default="", help="with --table: comma-separated variants to break down")
  args = vars(parser.parse_args(argv))
  nbytes = {"bfloat16": 2, "float32": 4}
  show, stages = args.pop("table"), [v for v in args.pop("stages").split(",") if v]
  if any(v not in VARIANTS for v in stages):
    parser.error(f"--stages takes variants among {VARIANTS}")
  args["dtype_bytes"], args["param_bytes"] = nbytes[args.pop("dtype")], nbytes[args.pop("param_dtype")]
  shape = Shape(**args)
  if shape.heads % shape.kv_heads or not 0 <= shape.shared <= shape.slots or shape.slots - shape.shared > (
      shape.chapters - shape.shared):
    parser.error("need heads % kv_heads == 0 and 0 <= shared <= slots, slots - shared <= chapters - shared")
  result = analyse(shape)
  print(json.dumps(result, allow_nan=False))
  if show:
    print(table(result))
    for variant in stages:
      print()
      print(stage_table(result, variant))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
