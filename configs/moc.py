"""Mixture-of-Chapters models: `--config=configs/moc.py:NAME[,runlocal]`.

NAME: `262k` (the paper model, MoC-PT base_small_run2 / run5, with MoC-PT's routing), `small` and `tiny` (CPU work,
routed causally with a balance term over the routable chapters: `_balanced_causal`).
Sweeps of any of them (`get_sweep` below: topk, bank, topk_bank, iso_flop, demo, routing, bank_seeds, bank_scale,
budget, bank_lr, kinds) run through launch/sweep.py. `--config.memory.kind=pkm | hml` swaps the chapter memory for
product-key memory at each config's sizes (`pkm_*` fields below; the 262k config keeps Memory+'s 1024^2 slots).
"""
from moc_jax.config import schema


def _262k(c):
  # As trained (MoC-PT run5): one document per 1024-token row, 1024 rows per update, WSD 250 / 8160 / 9600.
  c.data.update(seq_len=1024, layout="pad_truncate")
  c.train.update(batch_size=256, grad_accum=4, steps=9600, warmup_steps=250, decay_start_step=8160)
  return c


def _balanced_causal(c):
  """`routed` balance + causal `prefix` routing, where base_config keeps MoC-PT's `mocpt` + `sequence` (so the paper
  config, imports and the parity fixtures stay MoC-PT's). docs/routing.md measured why on `tiny`: a non-causal
  routing input pools the tokens being predicted, so its validation CE includes a leak (0.095 nats for `segment`,
  the same weights evaluated with `prefix`), and under MoC-PT's term the `sequence` router reads 38% of the
  routable chapters at max/mean load 8.0, while `routed` + `prefix` reads every one at 2.4 (450 steps, 3 seeds).
  Pooling stays `mean`: attention pooling's 3-seed gain there is within 1.0-1.4 combined standard errors at 900 and
  1,800 steps and reversed at 450 (CE 0.3030 against 0.2979), and one seed in three keyed it on the template
  rather than the entity."""
  c.memory.update(load_balance="routed", routing="prefix")
  return c


def _small(c):
  _balanced_causal(c)
  c.model.update(vocab_size=512, d_model=256, num_layers=8, num_heads=8, num_kv_heads=4,
                 mlp_dim=768, max_seq_len=256)
  c.memory.update(num_tokens=257 * 32, num_chapters=257, num_shared=1, top_k=16,
                  num_heads=8, num_kv_heads=8, layer_indices=(1, 3, 5, 7))
  c.memory.update(pkm_sub_keys=128, pkm_top_k=16, pkm_key_dim=128)  # memory.kind=pkm | hml: 16,384 slots
  c.data.seq_len = 256
  return c


def _tiny(c):
  _balanced_causal(c)
  c.model.update(vocab_size=260, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 mlp_dim=192, max_seq_len=256)
  c.memory.update(num_tokens=65 * 16, num_chapters=65, num_shared=1, top_k=8,
                  num_heads=4, num_kv_heads=4, layer_indices=(1, 3))
  c.memory.update(pkm_sub_keys=64, pkm_top_k=8, pkm_key_dim=64)  # memory.kind=pkm | hml: 4,096 slots, 4 heads
  # `make run`: the embedded facts corpus, sized so recall is measurable within minutes on 2 CPU cores. Its
  # documents run to 218 tokens with their EOS (134 on average), so 256-token rows of whole documents cut no fact
  # in two (tests/data/test_tiny_rows.py); 16 rows a step keep the 4,096 token slots of 32 packed 128-token rows.
  c.data.update(seq_len=256, layout="pack_whole")
  c.data.facts.update(num_entities=64, num_docs=8000, num_val_docs=400)
  c.train.update(batch_size=16, steps=900, warmup_steps=30, decay_start_ratio=0.8, base_lr=3e-3,
                 memory_lr=3e-3, log_every=25, eval_every=150, eval_batches=8, checkpoint_every=300)
  return c


MODELS = {"262k": _262k, "small": _small, "tiny": _tiny}


def get_config(arg="tiny"):
  name, mods = schema.parse_arg(arg, MODELS)
  c = MODELS[name](schema.base_config())
  c.name = f"moc-{name}"
  if "runlocal" in mods:
    c = schema.runlocal(c)
  unknown = mods - {"runlocal"}
  if unknown:
    raise ValueError(f"config arg {arg!r}: unknown modifiers {sorted(unknown)}; known: ['runlocal']")
  return c


# ---- sweeps (big_vision's get_hyper): `launch/sweep.py --config=configs/moc.py:NAME --sweep=SWEEP` ----
# A sweep is a list of {dotted field: value} overrides of get_config(NAME), each applied as
# `--config.<field>=<value>`; moc_jax/sweeps.py names, validates and launches them. Every sweep is a
# function of the model config, so `tiny` gets tiny points and `262k` the paper's.

TOP_K = (1, 2, 4, 8, 16, 32, 64)
ISO_MLP_MULTIPLE = 16  # the iso-FLOP vanilla's SwiGLU width is a multiple of this


def _topk(c):
  """The paper's top-k range at the config's bank; a k above the routable chapters is left out."""
  routable = c.memory.num_chapters - c.memory.num_shared
  return [{"memory.top_k": k} for k in TOP_K if k <= routable]


def _bank(c):
  """Bank sizes at the config's chapter size and top-k, so every point reads the same k·T tokens: routed
  chapters doubling from top_k (the bank is what one sequence reads) to the config's bank; 4,160 to 262,208
  tokens for 262k, 144 to 1,040 for tiny."""
  mem = c.memory
  per_chapter = mem.num_tokens // mem.num_chapters
  chapters, routed = [], mem.top_k
  while mem.num_shared + routed < mem.num_chapters:
    chapters.append(mem.num_shared + routed)
    routed *= 2
  chapters.append(mem.num_chapters)
  return [{"memory.num_chapters": n, "memory.num_tokens": n * per_chapter} for n in chapters]


def _topk_bank(c):
  """Every (top-k, bank) pair of the two sweeps in which the top-k fits the bank."""
  return [{**k, **bank} for bank in _bank(c) for k in _topk(c)
          if k["memory.top_k"] <= bank["memory.num_chapters"] - c.memory.num_shared]


NO_MEMORY = {"memory.enabled": False, "memory.placement": "none"}  # the backbone (configs/vanilla.py)


def _iso_mlp_dim(c, top_k):
  """MLP width of the vanilla backbone whose model FLOPs per token (forward + backward, the
  estimator's MFU count) are closest to the MoC model's at `top_k`; FLOPs are linear in the width."""
  from moc_jax.flops import model_flops_per_token
  moc, dense = c.copy_and_resolve_references(), c.copy_and_resolve_references()
  moc.memory.top_k = top_k
  dense.memory.update(enabled=False, placement="none")

  def cost(width):
    dense.model.mlp_dim = width
    return model_flops_per_token(dense)

  width = c.model.mlp_dim + (model_flops_per_token(moc) - cost(c.model.mlp_dim)) / (
      cost(c.model.mlp_dim + 1) - cost(c.model.mlp_dim))
  return max(ISO_MLP_MULTIPLE, ISO_MLP_MULTIPLE * round(width / ISO_MLP_MULTIPLE))


def _iso_flop(c):
  """The top-k points, each with its iso-FLOP vanilla (the backbone, SwiGLU widened to the MoC point's
  FLOPs per token; the residual mismatch shows in the plan and in collect's FLOPs column), and the
  backbone alone."""
  points = [NO_MEMORY]
  for k in _topk(c):
    points += [k, {**NO_MEMORY, "model.mlp_dim": _iso_mlp_dim(c, k["memory.top_k"])}]
  return points


def _demo(c):
  """Compute x bank on a CPU budget: the smallest, a middle and the config's bank of the `bank` sweep, and the
  backbone without memory, each trained for 1/16, 1/8 and 1/4 of the config's steps (docs/sweeps.md: tiny,
  12 runs on 2 cores)."""
  banks = _bank(c)

  def steps(divisor):
    out = {"train.steps": max(1, c.train.steps // divisor)}
    if c.train.decay_start_step is not None:
      out["train.decay_start_step"] = c.train.decay_start_step // divisor
    return out

  return [{**point, **steps(d)} for point in (banks[0], banks[len(banks) // 2], banks[-1], NO_MEMORY)
          for d in (16, 8, 4)]


SEEDS = (0, 1, 2)
BALANCES = ("mocpt", "routed", "aux_free")
ROUTINGS = ("sequence", "segment", "prefix")


def _seeds(points):
  """Every point once per seed (model initialisation and data order), seed by seed: a sweep cut short has
  every point at the first seeds."""
  return [{**p, "seed": s, "data.seed": s} for s in SEEDS for p in points]


def _routing(c):
  """Does the memory pay, and which router gets it to: the backbone, its iso-FLOP vanilla and MoC under every
  load balance x routing (aux_free: the bias alone, no loss term), plus `routed` + `prefix` with an attention-pooled
  routing input, 3 seeds each (docs/routing.md)."""
  arms = [NO_MEMORY, {**NO_MEMORY, "model.mlp_dim": _iso_mlp_dim(c, c.memory.top_k)}]
  for balance in BALANCES:
    for routing in ROUTINGS:
      arms.append({"memory.load_balance": balance, "memory.routing": routing,
                   **({"memory.load_balance_coef": 0.0} if balance == "aux_free" else {})})
  arms.append({"memory.load_balance": "routed", "memory.routing": "prefix", "memory.routing_pool": "attention"})
  return _seeds(arms)


def _bank_seeds(c):
  """The `bank` sweep (fixed read) once per seed: does a bigger bank pay under the config's router?"""
  return _seeds(_bank(c))


BANK_SCALE = (1, 4, 16, 64)  # the `bank_scale` sweep's routable chapters, in multiples of the config's


def _bank_scale(c):
  """Banks beyond the config's, at its chapter size and read (so the same k·T tokens are read): the config's
  routable chapters x 1, 4, 16 and 64, once per seed; 1,040 to 65,552 tokens for tiny. Meant for
  `memory.router=product`, whose router cost does not grow with the bank
  (docs/routing.md#banks-beyond-the-config-at-a-fixed-read-bank_scale-product-router)."""
  mem = c.memory
  per_chapter = mem.num_tokens // mem.num_chapters
  chapters = [mem.num_shared + m * (mem.num_chapters - mem.num_shared) for m in BANK_SCALE]
  return _seeds([{"memory.num_chapters": n, "memory.num_tokens": n * per_chapter} for n in chapters])


def _budget(c):
  """MoC and its iso-FLOP vanilla at 1/2, 1 and 2 times the config's steps, once per seed."""
  points = []
  for factor in (0.5, 1, 2):
    steps = {"train.steps": max(1, int(c.train.steps * factor))}
    if c.train.decay_start_step is not None:
      steps["train.decay_start_step"] = int(c.train.decay_start_step * factor)
    points += [steps, {**NO_MEMORY, "model.mlp_dim": _iso_mlp_dim(c, c.memory.top_k), **steps}]
  return _seeds(points)


BANK_LR_MULTIPLES = (0, 0.01, 0.1, 1, 10)  # the `bank_lr` sweep's bank LRs, in multiples of train.memory_lr


def _bank_lr(c):
  """How fast the bank should learn: its LR at 0 (a fixed random bank), 0.01x, 0.1x, 1x and 10x the memory
  layers', once per seed. The bank's tokens are RMS-normalised before they are read, so only their direction
  counts, and an Adam step of a given LR turns a token of small norm further
  (docs/routing.md#how-fast-the-bank-learns-bank_lr)."""
  return _seeds([{"train.bank_lr": float(f"{m * c.train.memory_lr:.6g}")} for m in BANK_LR_MULTIPLES])


# Retention (docs/retention.md, `python -m experiments.retention`): pre-train on facts A until they are known, then
# learn new facts B one entity per update, every arm swept over its rate (and SMF's t), compared at matched learning.
RETENTION_FACTS = {"data.facts.num_entities": 32, "data.facts.zipf_a": 0.5}  # facts A
# facts B: 16 new entities, one a row, 16 rows an update at a constant rate
RETENTION_B = {"data.facts.seed": 1, "data.facts.zipf_a": 0.0, "data.facts.num_entities": 16,
               "data.layout": "pad_truncate", "train.batch_size": 16, "train.grad_accum": 1,
               "train.schedule": "constant", "train.warmup_steps": 0}
# ... streamed one entity an update, each in 16 paraphrased documents (the harness runs 16 steps: the stream)
RETENTION_STREAM = {**RETENTION_B, "data.facts.order": "stream", "data.facts.num_docs": 256, "data.shuffle": False}
RETENTION_LRS = (3e-5, 1e-4, 3e-4, 1e-3)  # full finetuning and the memory alone (AdamW)
RETENTION_SGD = (1.0, 3.0, 10.0)          # sparse memory finetuning: SGD on the chosen chapters
RETENTION_T = (1, 2, 4, 8)                # ... its chapters per update
FROZEN_REST = {"train.base_lr": 0.0, "train.memory_lr": 0.0}
# The paper's arm: instruction tuning, a shift to the chat format (MoC-PT's plain <|user|> rows, here questions on
# facts B), at a tenth of the pre-training rate (the harness writes the chat files and sets data.name)
RETENTION_FORMAT = {**RETENTION_B, "data.chat_format": "plain"}
RETENTION_FORMAT_LR = 0.1       # of the pre-training rate
RETENTION_FORMAT_BANK = 0.1     # the bank's `low` rate, of the format shift's


def _retention_moc(c) -> dict:
  """Phase 1's memory: FFN memory fetched by the document's cluster path, the memory that holds the largest share of
  the facts it helps recall on tiny (docs/results/2026-11-28-subtree-ffn-tiny.md; chapters fetched the same way hold
  less, and less the longer they train: docs/results/2026-11-28-retention-phase1.md)."""
  return _ffn_arm(c)


def _retention_dense(c) -> dict:
  """The iso-FLOP dense model of phase 1's memory: the backbone, SwiGLU widened to its FLOPs per token."""
  moc = c.copy_and_resolve_references()
  moc.update_from_flattened_dict(_retention_moc(c))
  return {**NO_MEMORY, "model.mlp_dim": _iso_mlp_dim(moc, moc.memory.top_k)}


def _retention_pretrain(c):
  """Phase 1: MoC and its iso-FLOP dense model on facts A, once per seed."""
  return _seeds([{**RETENTION_FACTS, **_retention_moc(c)},
                 {**RETENTION_FACTS, **_retention_dense(c)}])


def _retention_finetune(c):
  """Phase 2 from phase 1's weights (the harness adds train.init_from, and A's tree as data.cluster.tree): the
  stream of facts B. Every arm a sweep: full finetuning of the dense model and of MoC at RETENTION_LRS; MoC's memory
  alone (every chapter, AdamW; the rest at LR 0) at the same rates; sparse memory finetuning (the top-t chapters
  by TF-IDF, SGD; the rest at LR 0) at RETENTION_T x RETENTION_SGD; its controls, t random chapters of those read
  and the top-t by TF alone, at t = 4 and every SGD rate."""
  moc = {**RETENTION_STREAM, **_retention_moc(c)}
  dense = {**RETENTION_STREAM, **_retention_dense(c)}
  smf = {**moc, **FROZEN_REST, "train.bank_optimizer": "smf", "train.bank_rule": "sgd"}
  points = [{**arm, "train.base_lr": lr, "train.memory_lr": lr} for arm in (dense, moc) for lr in RETENTION_LRS]
  points += [{**moc, **FROZEN_REST, "train.bank_lr": lr} for lr in RETENTION_LRS]
  points += [{**smf, "train.smf_top_t": t, "train.bank_lr": r} for t in RETENTION_T for r in RETENTION_SGD]
  points += [{**smf, "train.smf_top_t": 4, "train.smf_rank": rank, "train.bank_lr": r} for rank in ("random", "tf")
             for r in RETENTION_SGD]
  return _seeds(points)


def _retention_format(c):
  """The paper's retention arm from phase 1's weights (the harness adds train.init_from, A's tree, and the chat files
  as data.name): the chat-format shift at RETENTION_FORMAT_LR of the pre-training rate, for the dense model and for
  MoC with its bank frozen (out of the optimizer), at RETENTION_FORMAT_BANK of that rate, and at it."""
  lr = float(f"{RETENTION_FORMAT_LR * c.train.base_lr:.6g}")
  rates = {"train.base_lr": lr, "train.memory_lr": lr}
  moc = {**RETENTION_FORMAT, **_retention_moc(c), **rates}
  dense = {**RETENTION_FORMAT, **_retention_dense(c), **rates}
  return _seeds([dense, {**moc, "train.freeze_bank": True},
                 {**moc, "train.bank_lr": float(f"{RETENTION_FORMAT_BANK * lr:.6g}")}, moc])


def _kinds(c):
  """Every memory.kind at the config's sizes and the backbone without memory, once per seed: which memory the
  same placement, trainer and budget reward (docs/model.md#memory-kinds). FFN memory is fetched by cluster paths:
  the `cluster` sweep runs it."""
  return _seeds([*({"memory.kind": kind} for kind in schema.MEMORY_KINDS if kind != "ffn"), NO_MEMORY])


CLUSTER_K = 4  # the `cluster` sweep's tree: 4-ary, data.cluster.levels (2) deep


def _cluster_arm(c) -> dict:
  """Cluster routing over the config's routable chapters: a CLUSTER_K-ary tree whose leaves own as many chapters as
  fit after each level-0 node has its share (tiny: 4·4 + 3·16 = 64, read 1 + 7 where the router reads 1 + 8)."""
  levels, routable = c.data.cluster.levels, c.memory.num_chapters - c.memory.num_shared
  leaf = (routable - CLUSTER_K) // CLUSTER_K ** levels  # the rest, at least 1 chapter, to each level-0 node
  per_level = (routable - leaf * CLUSTER_K ** levels) // CLUSTER_K, *(0,) * (levels - 2), leaf
  if sum(r * CLUSTER_K ** (level + 1) for level, r in enumerate(per_level)) != routable or leaf < 1:
    raise ValueError(f"the `cluster` sweep cannot lay {routable} routable chapters on a {CLUSTER_K}-ary tree of "
                     f"{levels} levels")
  return {"memory.routing": "cluster", "data.cluster.k": CLUSTER_K, "memory.cluster_chapters": per_level}


def _ffn_arm(c) -> dict:
  """FFN memory (memory.kind=ffn) on the `cluster` arm's tree, with as many parameters as the config's chapter bank
  fit in columns of 3·d, split evenly between the levels, no shared column (the backbone's MLP is the shared part):
  tiny 346 columns' worth, 43 per level-0 node and 10 per leaf, 332 in all, 53 fetched per token."""
  levels, k = c.data.cluster.levels, CLUSTER_K
  columns = c.memory.num_tokens * (c.memory.dim or c.model.d_model) // (3 * c.model.d_model)
  per_level = tuple(columns // (levels * k ** (level + 1)) for level in range(levels))
  return {"memory.kind": "ffn", "memory.routing": "cluster", "data.cluster.k": k, "memory.num_shared": 0,
          "memory.cluster_chapters": per_level,
          "memory.num_chapters": sum(r * k ** (level + 1) for level, r in enumerate(per_level))}


def _cluster(c):
  """Memory fetched by the document's path against the learned router (the config's), with the generic-memory
  control (data.cluster.generic = 1/(k+1), the paper's co-training: Σ r_l more chapters), the learned router
  choosing within the document's subtree (`subtree`: tiny, top-8 of a subtree's 4 + 4·3 chapters), FFN memory on the
  same tree (`_ffn_arm`), and the iso-FLOP dense model, once per seed (docs/routing.md#cluster-routing-
  memorycluster_chapters)."""
  arm = _cluster_arm(c)
  generic = sum(arm["memory.cluster_chapters"])
  per_chapter = c.memory.num_tokens // c.memory.num_chapters
  return _seeds([{}, arm, {**arm, "data.cluster.generic": round(1 / (CLUSTER_K + 1), 6),
                           "memory.num_chapters": c.memory.num_chapters + generic,
                           "memory.num_tokens": (c.memory.num_chapters + generic) * per_chapter},
                 {**arm, "memory.routing": "subtree"}, _ffn_arm(c), {**NO_MEMORY, "model.mlp_dim": _iso_mlp_dim(c, c.memory.top_k)}])


SWEEPS = {"topk": _topk, "bank": _bank, "topk_bank": _topk_bank, "iso_flop": _iso_flop, "demo": _demo,
          "routing": _routing, "bank_seeds": _bank_seeds, "bank_scale": _bank_scale, "budget": _budget,
          "bank_lr": _bank_lr, "kinds": _kinds, "cluster": _cluster,
          "retention_pretrain": _retention_pretrain, "retention_finetune": _retention_finetune,
          "retention_format": _retention_format}


def get_sweep(name, config):
  """Sweep `name` of `config` (get_config's result): a list of {dotted field: value} overrides."""
  if name not in SWEEPS:
    raise ValueError(f"unknown sweep {name!r}; known: {sorted(SWEEPS)}")
  return SWEEPS[name](config)
