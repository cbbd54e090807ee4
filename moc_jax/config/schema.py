"""Every config field and its default: the one structure that configs, saved runs and imports fill in.

Configs are code (`configs/*.py` build on `base_config()`); a saved run's config.json is read back into
it (config/load.py), and MoC-PT's YAML is mapped onto it (convert/mocpt.py). Defaults are MoC-PT's
paper-run values where it has one. Config arguments are big_vision style: `name[,modifier...]`, e.g.
`262k,runlocal`.
"""
from __future__ import annotations

import os

from ml_collections import config_dict

DEFAULT_DATA_DIR = "~/.cache/moc_jax/data"
DATA_DIR_ENV = "MOC_JAX_DATA_DIR"

# The values an enumerated field accepts (config/validate.py rejects anything else).
MEMORY_KINDS = ("chapters", "pkm", "hml", "ffn")
CHAPTER_KINDS = ("chapters", "ffn")  # kinds whose bank rows are chapters, named by chapter ids (ffn: a column each)
QUERY_NORMS = ("none", "layernorm")
PLACEMENTS = ("all", "first_k", "last_k", "every_n", "spread", "custom", "none")
SHARINGS = ("shared", "per_layer", "every_k_layers")
VARIANTS = ("A", "B")
TOKEN_NORMS = ("rms", "layernorm", "none")
GENERIC_PATH = -2  # a cluster path at every level that reads the generic chapters (data.cluster.generic); -1: padding
ROUTINGS = ("sequence", "segment", "token", "prefix", "chunk", "cluster", "subtree")
TREE_ROUTINGS = ("cluster", "subtree")  # read by the batch's cluster paths (data.cluster)
CAUSAL_ROUTINGS = ("token", "prefix", "chunk")  # a position's chapters depend only on tokens at or before it
DECODE_ROUTINGS = ("auto", "sequence", "rolling", "hybrid", *CAUSAL_ROUTINGS)
SHARDED_READS = ("auto", "ring", "scatter")
LOAD_BALANCES = ("mocpt", "routed", "aux_free")
ROUTING_POOLS = ("mean", "attention")
ROUTERS = ("linear", "product")
ATTENTION_IMPLS = ("auto", "pallas", "xla", "reference")
DTYPES = ("float32", "bfloat16", "float16")
REMATS = ("none", "full", "dots")
# MoC-PT's model.hidden_activation: SwiGLU (gated: gate, up and down projections) or one of the plain MLPs (up, the
# activation, down); the model (model/layers.py) and the FLOPs (flops.py) each map every name.
HIDDEN_ACTIVATIONS = ("swiglu", "silu", "relu", "gelu", "sigmoid", "tanh")
SCHEDULES = ("wsd", "cosine", "linear", "constant")
BANK_OPTIMIZERS = ("dense", "lazy_adam", "smf")
BANK_RULES = ("adamw", "sgd")
SMF_RANKS = ("tfidf", "tf", "random")
BANK_STATE_MEMORY = ("device", "pinned_host")
DECAYING_SCHEDULES = ("wsd", "cosine", "linear")  # warm-up, hold until the decay start, decay
LAYOUTS = ("pack", "pack_whole", "pad_truncate")
PACK_BOUNDARIES = ("segment", "eos")
CHAT_FORMATS = ("plain", "chatml")
UPSCALE_COPIES = ("next", "previous")


def parse_arg(arg, known_names):
  """Splits `name,mod1,mod2` into (name, set(mods)); names the fix on a typo."""
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  if not parts or parts[0] not in known_names:
    raise ValueError(
        f"config arg {arg!r}: the first item must be one of {sorted(known_names)}"
        " (e.g. `configs/moc.py:tiny` or `configs/moc.py:262k,runlocal`)")
  return parts[0], set(parts[1:])


def base_config():
  """Every field, with MoC-PT's paper-run values where they have one."""
  c = config_dict.ConfigDict()
  c.name = "moc"
  c.seed = 0

  m = c.model = config_dict.ConfigDict()
  m.vocab_size = 49_152
  m.d_model = 768
  m.num_layers = 16
  m.num_heads = 12
  m.num_kv_heads = 4
  m.mlp_dim = 2304
  m.hidden_activation = "swiglu"  # swiglu | silu | relu | gelu | sigmoid | tanh (MoC-PT's; plain MLPs have no gate)
  m.max_seq_len = 1024
  m.rope_theta = 100_000.0
  m.norm_eps = 1e-5
  m.init_std = 0.02              # every Linear, the embedding, the router
  m.attn_out_init_std = 0.00378  # self-attention W_o (paper run value)
  m.mlp_out_init_std = 0.00378   # the MLP's W_down (paper run value)
  m.compute_dtype = "bfloat16"   # matmul inputs; params, residual, norms, softmax and loss stay float32
  m.param_dtype = "float32"
  m.remat = "full"               # none | full | dots : per-block activation checkpointing
  m.logits_chunk = 0             # > 0: the training loss computes logits this many positions at a time
  m.scan_layers = True           # scan the repeating group of layers when the placement is periodic

  mem = c.memory = config_dict.ConfigDict()
  mem.enabled = True             # False = vanilla backbone (no bank, no router)
  # chapters: Mixture of Chapters, a bank of chapters read by routed cross-attention (the fields from num_tokens to
  # mse_aux_coef) | pkm: product-key memory as Memory+ builds it (model/pkm.py) | hml: MIDUS's head-wise memory
  # block (model/hml.py); the pkm_* fields size both. Every kind shares the placement, block_variant, sharing (one
  # bank or value table per group of memory layers), wo_init_zero, the trainer, checkpoints and evaluation.
  mem.kind = "chapters"
  mem.num_tokens = 262_208
  mem.num_chapters = 4097
  mem.num_shared = 1             # chapters [0, num_shared) are always read
  mem.top_k = 64                 # routed chapters per sequence
  mem.routed_scaling_factor = 2.5
  mem.dim = config_dict.placeholder(int)  # None -> d_model
  mem.num_heads = 12
  mem.num_kv_heads = 12
  mem.placement = "custom"       # all | first_k | last_k | every_n | spread | custom | none
  mem.placement_k = 5            # first_k / last_k; spread: k layers, the middle of each of k equal spans of depth
  mem.placement_n = 3            # every_n: layers 0, n, 2n, ...
  mem.layer_indices = (2, 6, 10, 14)  # custom
  mem.sharing = "shared"         # shared | per_layer | every_k_layers
  mem.sharing_k = 2
  mem.block_variant = "A"        # A: SA -> mem -> MLP ; B: SA -> MLP -> mem -> MLP
  mem.token_norm = "rms"         # rms | layernorm | none : parameter-free norm of selected memory tokens
  mem.token_norm_eps = 1e-5
  mem.sharded_read = "auto"      # auto | ring | scatter : reading a chapter-sharded bank (model/chapter_read.py)
  # sequence (MoC-PT's paper mode) | segment (one decision per packed document): NOT causal;
  # token | prefix | chunk: causal (prefix and chunk pool within the position's document);
  # cluster: no router, a document reads the chapters of the nodes on its path down data.cluster's tree (NOT causal)
  mem.routing = "sequence"
  # cluster routing: r_l chapters owned by each node of level l (one entry per data.cluster.levels); the routable
  # chapters num_chapters - num_shared must be sum_l r_l * k**l, and a document reads num_shared + sum_l r_l
  mem.cluster_chapters = ()
  mem.routing_chunk = 64         # chunk routing: positions per routing decision
  # what a pooled decision (every routing but token) averages: mean (MoC-PT's: every position alike) | attention
  # (each position weighted by exp of a learned query's score on it, capped; the query starts at zero = mean)
  mem.routing_pool = "mean"
  # cached decoding: auto (the training routing if causal, else sequence) | sequence (routed once on the
  # prompt) | rolling | hybrid (MoC-PT's decode-only strategies) | token | prefix | chunk
  mem.decode_routing = "auto"
  mem.routing_window = 128       # rolling / hybrid: the last layer inputs a decoding decision averages
  mem.attention_impl = "auto"    # token/prefix/chunk reads: auto | pallas | xla | reference (kernels_pallas)
  # the per-position reads, `read_chunk` positions of every row at a time (0: the whole sequence at once): exact,
  # and the read's temporaries are one slice's (model/chapter_read.py `routed_attention`)
  mem.read_chunk = 0
  mem.init_std = 0.02
  mem.wo_init_zero = True
  # mocpt: MoC-PT's Switch term C·Σ f·P, exact (P counts the shared chapters, f does not) | routed: the Switch term
  # over the routable chapters only (1 when uniform) | aux_free: a per-chapter bias on the top-k choice moved by
  # aux_free_rate each update (DeepSeek-V3), plus the `routed` term weighted by load_balance_coef (0: the bias alone)
  mem.load_balance = "mocpt"
  # linear: one logit per chapter from a [d, C] matrix (MoC-PT's; its weights and update grow with the bank) |
  # product: the routable chapters on an a x b grid (a = ceil(sqrt(R))), a chapter's logit the sum of its row's and
  # its column's ([d, a] and [d, b] matrices, PKM's product keys), the shared chapters' from their own [d, s]
  mem.router = "linear"
  mem.load_balance_coef = 0.01   # 0 disables the term
  mem.aux_free_rate = 0.01       # aux_free: the bias step γ per update
  mem.z_loss_coef = 0.001
  mem.mse_aux_coef = 0.0
  # pkm / hml: N = pkm_sub_keys**2 value slots per table, found per token and head by product keys (top-k per
  # half, then the top-k of the k^2 sums, softmax over the k). Memory+'s sizes (Berges et al. 2024): 1024^2
  # slots, 4 heads of 512-d queries, top-32; MIDUS's HML: n = 64, top-4, its heads the attention's.
  mem.pkm_sub_keys = 1024        # n (pkm and hml)
  mem.pkm_top_k = 32             # k slots per head and token (pkm and hml)
  mem.pkm_heads = 4              # pkm: query heads, each with its own sub-keys (hml: model.num_heads)
  mem.pkm_key_dim = 512          # pkm: query width per head, split into two halves (hml: the head width)
  mem.pkm_value_dim = config_dict.placeholder(int)  # pkm: value width; None -> d_model (hml: the head width)
  mem.pkm_query_norm = "none"    # none | layernorm (parameter-free, each query half) : pkm and hml
  mem.pkm_gated = True           # pkm: Memory+'s output (y * silu(x W1)) W2; False: y itself (value width d_model)
  t = c.train = config_dict.ConfigDict()
  t.batch_size = 32              # global sequences per micro-batch
  t.grad_accum = 1               # micro-batches per update (loss = mean of micro-batch token means)
  t.steps = 9600                 # optimizer updates
  t.base_lr = 3e-4
  t.memory_lr = 6e-4             # routers, memory attention and norms
  t.bank_lr = config_dict.placeholder(float)  # None -> memory_lr; 0 -> MoC-PT's "frozen bank"
  t.freeze_bank = False          # drop the bank from the optimizer (no Adam state, no bank gradient)
  # dense: AdamW over every chapter (MoC-PT) | lazy_adam: AdamW over the chapters the update read | smf: sparse
  # memory finetuning, lazy AdamW over the smf_top_t chapters the update reads most against a background (optim.py)
  t.bank_optimizer = "dense"
  t.smf_top_t = 8                # smf: chapters per bank each update moves
  # lazy_adam / smf: the step of a row moved: adamw, or sgd (p -= lr·g: no moments, no weight decay; sparse memory
  # finetuning's, which forgets less with it)
  t.bank_rule = "adamw"
  # smf: how the top-t are ranked: tfidf (the method), or its controls tf (no idf: the chapters read most) and
  # random (t of the chapters the update read, drawn from the seed and the update's count)
  t.smf_rank = "tfidf"
  # lazy_adam: where the bank's optimizer state (moments, per-chapter counts) lives; pinned_host keeps it in host
  # memory and moves only the rows an update reads (optim.LazyBankOptimizer)
  t.bank_state_memory = "device"
  t.smf_background = config_dict.placeholder(str)  # smf: background counts; None -> <init_from>/bank_background.json
  t.weight_decay = 0.1
  # the bank's decoupled weight decay; None -> weight_decay (MoC-PT, every parameter alike). PKM-style memory
  # layers use 0 on their values; docs/routing.md#how-fast-the-bank-learns-bank_lr measures both here
  t.bank_weight_decay = config_dict.placeholder(float)
  t.b1, t.b2, t.eps = 0.9, 0.95, 1e-8
  t.clip_norm = 1.0              # 0 disables clipping
  t.schedule = "wsd"             # wsd | cosine | linear | constant
  t.warmup_steps = 250
  t.decay_start_step = config_dict.placeholder(int)
  t.decay_start_ratio = config_dict.placeholder(float)
  t.min_lr_ratio = 0.1
  # fractions of train.steps: at each, the run as a run that long would end (its decay from where that run's starts)
  # is evaluated as a branch, and the run goes on unchanged (moc_jax/train/cooldown.py); () -> none
  t.cooldowns = ()
  t.log_every = 10
  t.eval_every = 100
  t.eval_batches = config_dict.placeholder(int)  # None -> the whole validation split
  t.num_probes = 256             # moc_facts fact-recall probes scored at each evaluation
  t.checkpoint_every = 500
  t.keep_checkpoints = 3
  t.max_nonfinite = 5            # consecutive skipped updates before the run stops
  t.init_from = config_dict.placeholder(str)     # weights-only start from another workdir
  # depth up-scaling (moc_jax/upscale.py): start from the trained run in this workdir (config.json, checkpoints/), its
  # model with this config's memory inserted at the memory layers (MIDUS; Llama Pro), the same outputs at step 0
  t.upscale_from = config_dict.placeholder(str)
  t.upscale_copy = "next"        # hml: an inserted block's norm and q, k, v from the block after it (MIDUS) | previous
  t.freeze_base = False          # drop the backbone (group base) from the optimizer: only the memory trains
  t.progress = "auto"            # auto | bar | log

  # Device mesh (see moc_jax/sharding/mesh.py): axis sizes, -1 = the remaining devices.
  c.mesh = config_dict.ConfigDict(dict(data=-1, memory=1, fsdp=1, tensor=1))
  # logical axis -> mesh axis / axes / None (replicated): the only place model axes meet mesh axes.
  # Outside the memory read the memory axis is a batch and FSDP axis (as experts are in MoE expert parallelism).
  c.logical_axis_rules = (
      ("batch", ("data", "memory", "fsdp")), ("length", None), ("layers", None), ("vocab", "tensor"),
      ("embed", ("fsdp", "memory")), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor"), ("banks", None),
      ("chapters", "memory"), ("chapter_tokens", None), ("bank_embed", "fsdp"),
      ("chapter_logits", None), ("chapter_factors", None), ("slots", "memory"), ("value_embed", None))
  c.num_fake_devices = 0         # > 0: that many CPU devices (compile reports, mesh tests on one host)

  c.data = data_config()
  return c


def data_config() -> config_dict.ConfigDict:
  """Defaults for `config.data` (byte vocabulary, packed 256-token rows, the embedded corpus)."""
  c = config_dict.ConfigDict()
  c.name = "moc_facts"          # moc_facts | tfds:<name>[/config] | arrayrecord:<dir> | chat:<path.jsonl>
  c.data_dir = os.environ.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)
  c.tokenizer = "byte"          # byte | facts | hf:<tokenizer.json> | sp:<model.model>
  # pack (concatenated, split into rows) | pack_whole (whole documents per row, first fit, the rest padded) |
  # pad_truncate (MoC-PT: one document per row, truncated, right-padded); data/pipeline.py
  c.layout = "pack"
  c.pack_boundaries = "segment"  # segment (segment_ids + positions) | eos (EOS-separated, plain causal)
  c.seq_len = 256
  c.batch_size = 16             # per process, per micro-batch
  c.seed = 0
  c.shuffle = True
  c.num_threads = 2             # grain read threads
  c.prefetch = 2                # batches prepared ahead in a background thread (0: none)
  c.text_field = "text"
  c.chat_format = "plain"       # plain (MoC-PT's <|user|> fallback) | chatml
  # each document's path down a k-ary tree of `levels` levels, fitted by k-means on the training split's texts
  # (data/cluster_paths.py), rides in the batch as cluster_path; memory.routing=cluster reads by it. k = 0: none
  cl = c.cluster = config_dict.ConfigDict()
  cl.k = 0
  cl.levels = 2
  cl.seed = 0
  # > 0: a text is read by its first `words` words only, in fitting the tree and in finding a text's path. A question
  # repeats its document's subject (a biography's name: 2 words), not its facts; so read by its subject a document
  # and a question about it take one path, which carries nothing of the facts. 0: the whole text
  cl.words = 0
  # the generic-memory control (Pouransari et al. co-train with 1/(k+1)): each training document reads, with this
  # probability, a fixed set of generic chapters (as many as a path's, after the tree's in the bank) instead of its
  # path's; evaluation reports CE and recall with every document on the generic set beside its fetched one. 0: none
  cl.generic = 0.0
  # a tree saved by another run's data (a path to its .npz, e.g. the pre-training corpus's in
  # <data_dir>/cluster_trees/) used as it is instead of one fitted on this dataset: a model keeps the tree it learned
  # its chapters by when it reads new data (the retention study's phase 2). None: this dataset's
  cl.tree = config_dict.placeholder(str)

  # the moc_facts corpus: these are its only defaults (data/facts.py's MocFactsConfig is built from them)
  f = c.facts = config_dict.ConfigDict()
  f.num_entities = 2000
  f.seed = 0
  f.zipf_a = 1.1
  f.num_docs = 20_000
  f.num_val_docs = 1000
  f.probes_per_fact = 1
  f.num_candidates = 4
  # mixed (2-4 facts per document, in sentences) | biography (every attribute of one entity in one short line;
  # with zipf_a = 0 and many documents per entity: a store sized against the backbone's capacity, data/facts.py)
  f.style = "mixed"
  # shuffled (each training document's entity drawn Zipf(zipf_a)) | stream (entity 0's num_docs / num_entities
  # documents, then entity 1's, ...: with data.shuffle=False and one document a row, an update of that many rows
  # teaches one new entity, its facts in paraphrases: the retention study's stream)
  f.order = "shuffled"
  # A curriculum (Zucchet et al. 2025, "How do language models learn facts?": recall waits on a plateau that
  # lengthens with the number of individuals, and shortens on fewer): the first warmup_docs training documents each
  # name one of the first warmup_entities entities, the rest are drawn as before. With data.shuffle=False they come
  # first. 0 and 0: none
  f.warmup_entities = 0
  f.warmup_docs = 0
  # after the curriculum's documents, this many draw over a set of entities growing geometrically from warmup_entities
  # to all of them (data/facts.py), instead of all at once. 0: none
  f.ramp_docs = 0
  return c


def runlocal(c):
  """Same architecture, CPU-sized run (a smoke test of the full model)."""
  c.model.max_seq_len = 64
  c.data.seq_len = 64
  c.train.update(batch_size=2, grad_accum=1, steps=3, warmup_steps=1, decay_start_step=None, log_every=1,
                 eval_every=3, eval_batches=1, num_probes=8, checkpoint_every=3)
  return c
