"""Defaults shared by every model config (configs are code: see configs/moc.py).

Field names are ours; `moc_jax/convert/mocpt.py` maps MoC-PT's YAML names onto them.
Arguments are big_vision style: `name[,modifier...]`, e.g. `262k,runlocal`.
"""
from ml_collections import config_dict


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
  m.max_seq_len = 1024
  m.rope_theta = 100_000.0
  m.norm_eps = 1e-5
  m.init_std = 0.02              # every Linear, the embedding, the router
  m.attn_out_init_std = 0.00378  # self-attention W_o (paper run value)
  m.mlp_out_init_std = 0.00378   # SwiGLU W_down (paper run value)
  m.compute_dtype = "bfloat16"   # matmul inputs; params, residual, norms, softmax and loss stay float32
  m.param_dtype = "float32"
  m.remat = "full"               # none | full | dots : per-block activation checkpointing
  m.logits_chunk = 0             # > 0: the training loss computes logits this many positions at a time
  m.scan_layers = True           # scan the repeating group of layers when the placement is periodic

  mem = c.memory = config_dict.ConfigDict()
  mem.enabled = True             # False = vanilla backbone (no bank, no router)
  mem.num_tokens = 262_208
  mem.num_chapters = 4097
  mem.num_shared = 1             # chapters [0, num_shared) are always read
  mem.top_k = 64                 # routed chapters per sequence
  mem.routed_scaling_factor = 2.5
  mem.dim = config_dict.placeholder(int)  # None -> d_model
  mem.num_heads = 12
  mem.num_kv_heads = 12
  mem.placement = "custom"       # all | first_k | last_k | every_n | custom | none
  mem.placement_k = 5            # first_k / last_k
  mem.placement_n = 3            # every_n: layers 0, n, 2n, ...
  mem.layer_indices = (2, 6, 10, 14)  # custom
  mem.sharing = "shared"         # shared | per_layer | every_k_layers
  mem.sharing_k = 2
  mem.block_variant = "A"        # A: SA -> mem -> MLP ; B: SA -> MLP -> mem -> MLP
  mem.token_norm = "rms"         # rms | layernorm | none : parameter-free norm of selected memory tokens
  mem.token_norm_eps = 1e-5
  mem.sharded_read = "auto"      # auto | ring | scatter : reading a chapter-sharded bank (model/chapter_read.py)
  mem.routing = "sequence"       # sequence (MoC-PT's paper mode; NOT causal) | token | prefix | chunk (causal)
  mem.routing_chunk = 64         # chunk routing: positions per routing decision
  # cached decoding: auto (the training routing if causal, else sequence) | sequence (routed once on the
  # prompt) | rolling | hybrid (MoC-PT's decode-only strategies) | token | prefix | chunk
  mem.decode_routing = "auto"
  mem.routing_window = 128       # rolling / hybrid: the last layer inputs a decoding decision averages
  mem.attention_impl = "auto"    # token/prefix/chunk reads: auto | pallas | xla | reference (kernels_pallas)
  mem.init_std = 0.02
  mem.wo_init_zero = True
  mem.load_balance_coef = 0.01   # 0 disables the term
  mem.z_loss_coef = 0.001
  mem.mse_aux_coef = 0.0
  t = c.train = config_dict.ConfigDict()
  t.batch_size = 32              # global sequences per micro-batch
  t.grad_accum = 1               # micro-batches per update (loss = mean of micro-batch token means)
  t.steps = 9600                 # optimizer updates
  t.base_lr = 3e-4
  t.memory_lr = 6e-4             # routers, memory attention and norms
  t.bank_lr = config_dict.placeholder(float)  # None -> memory_lr; 0 -> MoC-PT's "frozen bank"
  t.freeze_bank = False          # drop the bank from the optimizer (no Adam state, no bank gradient)
  t.weight_decay = 0.1
  t.b1, t.b2, t.eps = 0.9, 0.95, 1e-8
  t.clip_norm = 1.0              # 0 disables clipping
  t.schedule = "wsd"             # wsd | cosine | linear | constant
  t.warmup_steps = 250
  t.decay_start_step = config_dict.placeholder(int)
  t.decay_start_ratio = config_dict.placeholder(float)
  t.min_lr_ratio = 0.1
  t.log_every = 10
  t.eval_every = 100
  t.eval_batches = config_dict.placeholder(int)  # None -> the whole validation split
  t.num_probes = 256             # moc_facts fact-recall probes scored at each evaluation
  t.checkpoint_every = 500
  t.keep_checkpoints = 3
  t.max_nonfinite = 5            # consecutive skipped updates before the run stops
  t.init_from = config_dict.placeholder(str)     # weights-only start from another workdir
  t.progress = "auto"            # auto | bar | log

  # Device mesh (see moc_jax/sharding.py): axis sizes, -1 = the remaining devices.
  c.mesh = config_dict.ConfigDict(dict(data=-1, memory=1, fsdp=1, tensor=1))
  # logical axis -> mesh axis / axes / None (replicated): the only place model axes meet mesh axes.
  # Outside the memory read the memory axis is a batch and FSDP axis (as experts are in MoE expert parallelism).
  c.logical_axis_rules = (
      ("batch", ("data", "memory", "fsdp")), ("length", None), ("layers", None), ("vocab", "tensor"),
      ("embed", ("fsdp", "memory")), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor"), ("banks", None),
      ("chapters", "memory"), ("chapter_tokens", None), ("bank_embed", "fsdp"),
      ("chapter_logits", None))
  c.num_fake_devices = 0         # > 0: that many CPU devices (compile reports, mesh tests on one host)

  from moc_jax.data import default_data_config
  c.data = default_data_config()
  return c


def runlocal(c):
  """Same architecture, CPU-sized run (a smoke test of the full model)."""
  c.model.max_seq_len = 64
  c.data.seq_len = 64
  c.train.update(batch_size=2, grad_accum=1, steps=3, warmup_steps=1, decay_start_step=None, log_every=1,
                 eval_every=3, eval_batches=1, num_probes=8, checkpoint_every=3)
  return c
