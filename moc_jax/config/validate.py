"""`validate()`: the single gate every config passes before anything is built.

Every inconsistent field is rejected here, with one message naming the field and the fix, before any array
is allocated or anything compiles. Model code reads fields, never re-checks them.
"""
from __future__ import annotations

import collections

import jax

from moc_jax.config.plan import (bank_ids, bank_shape, base_tables, decay_start_step, layer_plan, memory_layers,
                                 router_factors, shorter_run, subtree_chapters)
from moc_jax.config.schema import (ATTENTION_IMPLS, BANK_OPTIMIZERS, BANK_RULES, BANK_STATE_MEMORY, CHAT_FORMATS,
                                   DECAYING_SCHEDULES, DECODE_ROUTINGS, DTYPES, HIDDEN_ACTIVATIONS, LAYOUTS,
                                   LOAD_BALANCES, MEMORY_KINDS, PACK_BOUNDARIES, PLACEMENTS, QUERY_NORMS, REMATS,
                                   ROUTERS, ROUTING_POOLS, ROUTINGS, SCHEDULES, SHARDED_READS, SHARINGS, SMF_RANKS,
                                   TOKEN_NORMS, UPSCALE_COPIES, VARIANTS)
from moc_jax.errors import ConfigError, DataError
from moc_jax.sharding.mesh import shards, validate_mesh


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
  _enum(c, "model.hidden_activation", HIDDEN_ACTIVATIONS)
  _positive(c, "model.logits_chunk", allow_zero=True)
  if m.d_model % m.num_heads:
    _fail("model.num_heads", f"{m.num_heads} does not divide d_model {m.d_model}", "pick a divisor of d_model")
  if m.num_heads % m.num_kv_heads:
    _fail("model.num_kv_heads", f"{m.num_kv_heads} does not divide num_heads {m.num_heads}",
          "pick a divisor of num_heads (GQA groups)")
  if (m.d_model // m.num_heads) % 2:
    _fail("model.num_heads", f"head_dim {m.d_model // m.num_heads} is odd", "RoPE needs an even head_dim")
  if "data" in c:
    validate_data(c.data)
    if c.data.seq_len > m.max_seq_len:
      _fail("data.seq_len", f"{c.data.seq_len} > model.max_seq_len {m.max_seq_len}", "shorten data.seq_len")
  if "train" in c:
    _validate_train(c)
  if mem.enabled:
    _validate_memory(c)
  if "train" in c:
    _validate_upscale(c)
  if "mesh" in c:
    validate_mesh(c, _logical_dims(c))


def validate_data(d) -> None:
  """Rejects an invalid `config.data` with one DataError naming the field (the input pipeline checks the data
  config it is handed too, since it can be built without a whole config)."""
  for field, allowed in (("layout", LAYOUTS), ("pack_boundaries", PACK_BOUNDARIES), ("chat_format", CHAT_FORMATS)):
    if d[field] not in allowed:
      raise DataError(f"config.data.{field}: unknown value {d[field]!r}; use one of {list(allowed)}")
  for field, minimum in (("seq_len", 2), ("batch_size", 1), ("num_threads", 0), ("prefetch", 0), ("seed", 0)):
    if not isinstance(d[field], int) or isinstance(d[field], bool) or d[field] < minimum:
      raise DataError(f"config.data.{field}: must be an integer >= {minimum}, got {d[field]!r}")
  for field, minimum in (("k", 0), ("levels", 1), ("seed", 0), ("words", 0)):
    value = d.cluster[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
      raise DataError(f"config.data.cluster.{field}: must be an integer >= {minimum}, got {value!r}")
  if d.cluster.k == 1:
    raise DataError("config.data.cluster.k: 1 gives every document the same path; use k >= 2, or 0 for no paths")
  if d.name == "moc_facts" and d.facts.warmup_docs and d.shuffle:
    raise DataError(f"config.data.shuffle: True would spread data.facts.warmup_docs={d.facts.warmup_docs} curriculum "
                    "documents over the whole run; set data.shuffle=False so that they come first")
  generic = d.cluster.generic
  if isinstance(generic, bool) or not isinstance(generic, (int, float)) or not 0 <= generic < 1:
    raise DataError(f"config.data.cluster.generic: must be a probability in [0, 1), got {generic!r} (Pouransari et "
                    f"al.: 1/(k+1))")


def _validate_memory(c):
  """The placement, which every kind shares, then the fields of `memory.kind`."""
  m, mem = c.model, c.memory
  _enum(c, "memory.kind", MEMORY_KINDS)
  _enum(c, "memory.placement", PLACEMENTS)
  _enum(c, "memory.sharing", SHARINGS)
  _enum(c, "memory.block_variant", VARIANTS)
  for f in ("placement_k", "placement_n", "sharing_k"):
    _positive(c, f"memory.{f}")
  if mem.placement == "custom":
    bad = [i for i in mem.layer_indices if not 0 <= i < m.num_layers]
    if bad or len(set(mem.layer_indices)) != len(mem.layer_indices):
      _fail("memory.layer_indices", f"{tuple(mem.layer_indices)} has out-of-range or repeated layers {bad}",
            f"use distinct indices in [0, {m.num_layers})")
  if mem.placement in ("first_k", "last_k", "spread") and mem.placement_k > m.num_layers:
    _fail("memory.placement_k", f"{mem.placement_k} > num_layers {m.num_layers}", "use at most num_layers")
  if not memory_layers(c):
    _fail("memory.placement", f"{mem.placement!r} places no memory layer",
          "set memory.enabled=False for a vanilla model, or place at least one memory layer")
  if mem.kind == "chapters":
    _validate_chapters(c)
  elif mem.kind == "ffn":
    _validate_ffn(c)
  else:
    _validate_slots(c)


def _validate_ffn(c):
  """ffn: SwiGLU columns fetched by the document's cluster path (model/ffn_memory.py), a column a chapter: cluster
  routing's fields; no router and no memory attention, so nothing that shapes those applies."""
  mem = c.memory
  if mem.routing != "cluster":
    _fail("memory.routing", f"{mem.routing!r} with memory.kind='ffn': FFN memory columns are fetched by the "
          "document's path down the cluster tree", "set memory.routing='cluster' (with data.cluster.k and levels)")
  if mem.block_variant != "A":
    _fail("memory.block_variant", f"{mem.block_variant!r} with memory.kind='ffn': the columns widen the block's one "
          "MLP", "leave memory.block_variant='A'")
  if c.model.hidden_activation != "swiglu":
    _fail("model.hidden_activation", f"{c.model.hidden_activation!r} with memory.kind='ffn': the columns widen a "
          "SwiGLU MLP (gate, up and down)", "set model.hidden_activation='swiglu'")
  for f in ("num_chapters", "init_std"):
    _positive(c, f"memory.{f}")
  _positive(c, "memory.num_shared", allow_zero=True)
  _enum(c, "memory.routing_pool", ROUTING_POOLS)
  _enum(c, "memory.load_balance", LOAD_BALANCES)
  _validate_cluster(c)


def _validate_slots(c):
  """pkm and hml: the product keys and the value table (model/product_keys.py, pkm.py, hml.py)."""
  m, mem = c.model, c.memory
  _enum(c, "memory.pkm_query_norm", QUERY_NORMS)
  for f in ("pkm_sub_keys", "pkm_top_k", "pkm_heads", "pkm_key_dim"):
    value = mem[f]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      _fail(f"memory.{f}", f"must be an integer >= 1, got {value!r}", "set a valid value")
  if mem.pkm_top_k > mem.pkm_sub_keys ** 2:
    _fail("memory.pkm_top_k", f"{mem.pkm_top_k} > the {mem.pkm_sub_keys ** 2} slots of pkm_sub_keys "
          f"{mem.pkm_sub_keys}", "lower pkm_top_k or raise pkm_sub_keys")
  if mem.kind == "hml":
    if mem.block_variant != "A":
      _fail("memory.block_variant", f"{mem.block_variant!r} with memory.kind='hml': an hml memory block has no MLP, "
            "so it has no variant", "leave memory.block_variant='A'")
    return
  if mem.pkm_key_dim % 2:
    _fail("memory.pkm_key_dim", f"{mem.pkm_key_dim} is odd", "use an even width (two halves, one per sub-key set)")
  if mem.pkm_value_dim is not None and (not isinstance(mem.pkm_value_dim, int) or mem.pkm_value_dim < 1):
    _fail("memory.pkm_value_dim", f"must be an integer >= 1 or None, got {mem.pkm_value_dim!r}",
          "leave it None to use d_model")
  if not mem.pkm_gated and mem.pkm_value_dim not in (None, m.d_model):
    _fail("memory.pkm_value_dim", f"{mem.pkm_value_dim} with memory.pkm_gated=False: the ungated output is the "
          f"values themselves, d_model={m.d_model} wide", "leave pkm_value_dim None, or set pkm_gated=True")


def _validate_chapters(c):
  m, mem = c.model, c.memory
  _enum(c, "memory.token_norm", TOKEN_NORMS)
  _enum(c, "memory.routing", ROUTINGS)
  _enum(c, "memory.decode_routing", DECODE_ROUTINGS)
  _enum(c, "memory.routing_pool", ROUTING_POOLS)
  _enum(c, "memory.sharded_read", SHARDED_READS)
  _enum(c, "memory.load_balance", LOAD_BALANCES)
  _enum(c, "memory.router", ROUTERS)
  _enum(c, "memory.attention_impl", ATTENTION_IMPLS)
  for f in ("num_tokens", "num_chapters", "top_k", "num_heads", "num_kv_heads", "init_std", "token_norm_eps",
            "routing_chunk", "routing_window"):
    _positive(c, f"memory.{f}")
  for f in ("num_shared", "routed_scaling_factor", "load_balance_coef", "z_loss_coef", "mse_aux_coef",
            "aux_free_rate", "read_chunk"):
    _positive(c, f"memory.{f}", allow_zero=True)
  if mem.routing == "cluster":
    _validate_cluster(c)
  if mem.routing == "subtree":
    _validate_subtree(c)
  if mem.routing_pool == "attention" and mem.routing == "token":
    _fail("memory.routing_pool", "attention pooling with token routing, which pools nothing (each position routes "
          "on its own input)", "use routing_pool=mean, or a pooled routing (prefix, chunk, segment, sequence)")
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


def _validate_cluster(c):
  """cluster routing: the batch's paths (data.cluster) name the chapters, each node of level l owning
  memory.cluster_chapters[l] of the routable ones; no router, so nothing that shapes one applies."""
  mem = c.memory
  _validate_tree(c)
  if mem.routing_pool != "mean":
    _fail("memory.routing_pool", f"{mem.routing_pool!r} with memory.routing='cluster', which has no router to pool "
          "for", "leave memory.routing_pool='mean'")
  if mem.load_balance == "aux_free":
    _fail("memory.load_balance", "'aux_free' with memory.routing='cluster': there is no router whose choice a bias "
          "could move", "use 'routed' or 'mocpt' (no router, so neither term applies)")


def _validate_subtree(c):
  """subtree routing: the chapters laid out on the tree as cluster routing's, a linear router choosing top_k among
  those of the document's level-0 subtree (no generic chapters: every document has a subtree)."""
  mem = c.memory
  if "data" in c and c.data.cluster.generic:
    _fail("data.cluster.generic", f"{c.data.cluster.generic} with memory.routing='subtree': the generic control is "
          "cluster routing's", "set data.cluster.generic=0, or use memory.routing='cluster'")
  _validate_tree(c)
  if mem.router != "linear":
    _fail("memory.router", f"{mem.router!r} with memory.routing='subtree': the subtree masks the logits of a linear "
          "router", "use memory.router='linear'")
  if mem.top_k > subtree_chapters(c):
    _fail("memory.top_k", f"{mem.top_k} > the {subtree_chapters(c)} chapters of a level-0 subtree (sum of "
          "cluster_chapters[l] * data.cluster.k**l)", "lower top_k or give the tree's nodes more chapters")


def _validate_tree(c):
  """The chapters of cluster and subtree routing: the batch carries paths (data.cluster), and the bank holds the
  shared chapters, memory.cluster_chapters[l] per node of each level l, and (cluster routing) the generic ones."""
  mem, cluster = c.memory, c.data.cluster if "data" in c else None
  if cluster is None or not cluster.k:
    _fail("data.cluster.k", f"0 with memory.routing={mem.routing!r}: the batches carry no cluster paths to read by",
          "set data.cluster.k (the tree's branching, e.g. 16) and data.cluster.levels")
  per_level = tuple(mem.cluster_chapters)
  if len(per_level) != cluster.levels or any(not isinstance(r, int) or isinstance(r, bool) or r < 0
                                             for r in per_level) or not any(per_level):
    _fail("memory.cluster_chapters", f"{per_level!r} is not {cluster.levels} integers >= 0 (one per level of "
          f"data.cluster.levels={cluster.levels}), not all 0", "give the chapters each node of a level owns, e.g. "
          f"{(1,) * cluster.levels}")
  owned = sum(r * cluster.k ** (level + 1) for level, r in enumerate(per_level))
  generic = sum(per_level) if cluster.generic else 0
  if mem.num_chapters - mem.num_shared != owned + generic:
    also = f" and {generic} generic ones (data.cluster.generic={cluster.generic})" if generic else ""
    _fail("memory.num_chapters", f"{mem.num_chapters} leaves {mem.num_chapters - mem.num_shared} routable chapters "
          f"beside num_shared={mem.num_shared}, and the tree's nodes own {owned} (sum of cluster_chapters[l] * "
          f"data.cluster.k**(l+1)){also}", f"set num_chapters={mem.num_shared + owned + generic}"
          + (" (and num_tokens to a multiple)" if mem.kind == "chapters" else ""))


def _validate_train(c):
  t = c.train
  for f in ("batch_size", "grad_accum", "steps", "log_every", "eval_every", "checkpoint_every",
            "keep_checkpoints", "max_nonfinite"):
    _positive(c, f"train.{f}")
  for f in ("base_lr", "memory_lr", "weight_decay", "clip_norm", "warmup_steps", "min_lr_ratio", "num_probes"):
    _positive(c, f"train.{f}", allow_zero=True)
  if t.bank_lr is not None and t.bank_lr < 0:
    _fail("train.bank_lr", f"must be >= 0 or None, got {t.bank_lr}", "use 0 for a frozen bank, None for memory_lr")
  if t.bank_weight_decay is not None and t.bank_weight_decay < 0:
    _fail("train.bank_weight_decay", f"must be >= 0 or None, got {t.bank_weight_decay}",
          "use 0 for no decay on the bank, None for train.weight_decay")
  _enum(c, "train.schedule", SCHEDULES)
  _validate_bank_optimizer(c)
  if t.warmup_steps > t.steps:
    _fail("train.warmup_steps", f"{t.warmup_steps} > train.steps {t.steps}", "shorten the warm-up")
  if t.schedule in DECAYING_SCHEDULES and t.decay_start_step is not None and t.decay_start_step > t.steps:
    _fail("train.decay_start_step", f"{t.decay_start_step} > train.steps {t.steps}: the learning rate would never "
          "decay", "set it <= train.steps (shortening a run: scale both), or use train.decay_start_ratio")
  if t.decay_start_ratio is not None and not 0 <= t.decay_start_ratio <= 1:
    _fail("train.decay_start_ratio", f"{t.decay_start_ratio} is outside [0, 1]", "use a fraction of train.steps")
  _validate_cooldowns(t)
  for f in ("b1", "b2"):
    if not 0 <= t[f] < 1:
      _fail(f"train.{f}", f"Adam beta must be in [0, 1), got {t[f]}", "e.g. 0.9 / 0.95")
  _positive(c, "train.eps")
  import jax
  if (t.batch_size * t.grad_accum) % jax.process_count():
    _fail("train.batch_size", f"{t.batch_size}*{t.grad_accum} is not divisible by {jax.process_count()} processes",
          "use a global batch divisible by the process count")


def _validate_cooldowns(t):
  """Each of train.cooldowns is a shorter run with a decay of its own, starting after at least one update; two that
  branch at the same update would be one."""
  if not isinstance(t.cooldowns, (tuple, list)):
    _fail("train.cooldowns", f"{t.cooldowns!r} is not a tuple", "give fractions of train.steps, e.g. (0.25, 0.5)")
  if t.cooldowns and t.schedule not in DECAYING_SCHEDULES:
    _fail("train.cooldowns", f"set with train.schedule={t.schedule!r}, which never decays",
          f"use one of {list(DECAYING_SCHEDULES)}, or train.cooldowns=()")
  starts = set()
  for f in t.cooldowns:
    if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f < 1:
      _fail("train.cooldowns", f"{f!r} is not a fraction of train.steps in (0, 1)", "e.g. (0.25, 0.5)")
    s = shorter_run(t, round(f * t.steps))
    start = decay_start_step(s)
    if not 1 <= start < s.steps:
      _fail("train.cooldowns", f"{f:g} of train.steps is a run of {s.steps} steps whose decay would start at step "
            f"{start}: it has no decay after an update", "give a larger fraction, or a decay start within it "
            "(train.decay_start_ratio)")
    if start in starts:
      _fail("train.cooldowns", f"two of {tuple(t.cooldowns)} start their decay at step {start}",
            "give each fraction once, further apart")
    starts.add(start)


def _validate_bank_optimizer(c):
  """lazy_adam and smf need a bank that trains: refused with freeze_bank (no bank optimizer at all) and without
  memory; smf needs a top-t within the bank and background counts to rank against."""
  t = c.train
  _enum(c, "train.bank_optimizer", BANK_OPTIMIZERS)
  _enum(c, "train.bank_state_memory", BANK_STATE_MEMORY)
  _enum(c, "train.bank_rule", BANK_RULES)
  _enum(c, "train.smf_rank", SMF_RANKS)
  if t.bank_rule != "adamw" and t.bank_optimizer == "dense":
    _fail("train.bank_rule", f"{t.bank_rule!r} with train.bank_optimizer='dense': the rule is the lazy optimizers' "
          "row step", "set train.bank_optimizer='lazy_adam' or 'smf', or leave train.bank_rule='adamw'")
  if t.bank_state_memory != "device" and t.bank_optimizer != "lazy_adam":
    _fail("train.bank_state_memory", f"{t.bank_state_memory!r} with train.bank_optimizer={t.bank_optimizer!r}: only "
          "lazy_adam's update reads the bank's optimizer state row by row", "set train.bank_optimizer='lazy_adam', "
          "or leave train.bank_state_memory='device'")
  if t.bank_state_memory != "device":
    rows = bank_shape(c).row_axis  # chapters, or a value table's slots
    if shards(c, rows) > 1:
      _fail("train.bank_state_memory", f"{t.bank_state_memory!r} with the bank's {rows} split {shards(c, rows)} "
            f"ways: each device then updates its own {rows} whole, on the device", "leave "
            f"train.bank_state_memory='device', or map the logical axis `{rows}` to no mesh axis of size > 1")
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if t.bank_state_memory not in kinds:
      _fail("train.bank_state_memory", f"{t.bank_state_memory!r}: this {jax.default_backend()} backend has no such "
            f"memory (it has {sorted(kinds)})", "leave train.bank_state_memory='device'")
  if t.bank_optimizer == "dense":
    return
  if t.freeze_bank:
    _fail("train.bank_optimizer", f"{t.bank_optimizer!r} with train.freeze_bank=True: a frozen bank has no optimizer",
          "set train.freeze_bank=False, or leave train.bank_optimizer='dense'")
  if not c.memory.enabled:
    _fail("train.bank_optimizer", f"{t.bank_optimizer!r} on a model without memory (memory.enabled=False): there is "
          "no bank", "leave train.bank_optimizer='dense'")
  if t.bank_optimizer != "smf":
    return
  if c.memory.kind not in ("chapters", "ffn"):
    _fail("train.bank_optimizer", f"'smf' with memory.kind={c.memory.kind!r}: sparse memory finetuning ranks chapters "
          "(or FFN columns) against a background of their reads", "use train.bank_optimizer='lazy_adam' (AdamW over "
          "the slots read)")
  if not 1 <= t.smf_top_t <= c.memory.num_chapters:
    _fail("train.smf_top_t", f"{t.smf_top_t} is outside [1, memory.num_chapters={c.memory.num_chapters}]",
          "use the number of chapters per bank each update may move")
  if not t.smf_background and not t.init_from:
    _fail("train.smf_background", "smf ranks chapters against background counts, and neither train.smf_background "
          "nor train.init_from names them", "run `python -m moc_jax.eval.background --workdir=<pre-training run>` "
          "and pass --config.train.init_from=<that run> (or --config.train.smf_background=<its json>)")


def _placement_field(c) -> str:
  """The field that says where the memory layers are: layer_indices for a custom placement, else the placement."""
  return "memory.layer_indices" if c.memory.placement == "custom" else "memory.placement"


def _validate_upscale(c):
  """train.upscale_from and freeze_base as far as the config alone decides; `validate_upscale` checks it against the
  base run's config when a run starts from it."""
  t, mem = c.train, c.memory
  _enum(c, "train.upscale_copy", UPSCALE_COPIES)
  if t.freeze_base and not mem.enabled:
    _fail("train.freeze_base", "True with memory.enabled=False: every parameter is the backbone's, so nothing would "
          "train", "set train.freeze_base=False, or give the model memory to train alone")
  if not t.upscale_from:
    return
  if t.init_from:
    _fail("train.upscale_from", f"set with train.init_from={t.init_from!r}: both name the weights the run starts from",
          "set one of the two")
  if not mem.enabled:
    _fail("train.upscale_from", "set with memory.enabled=False: up-scaling inserts memory and this model has none",
          "set memory.kind and where it goes (memory.placement=custom with layer_indices, or placement=spread)")
  if mem.block_variant != "A":
    _fail("memory.block_variant", f"{mem.block_variant!r} with train.upscale_from: variant B adds an MLP to each "
          "memory layer, which would change the base model's outputs", "leave memory.block_variant='A'")
  if mem.kind != "hml" and not mem.wo_init_zero:
    _fail("memory.wo_init_zero", f"False with train.upscale_from: the inserted {mem.kind} memory's output would start "
          "non-zero and change the base model's outputs", "leave memory.wo_init_zero=True")


# the fields of the base run that an up-scaled model keeps (validate_upscale): its backbone's, and (a base with
# memory) its memory's but the placement and sharing, which say where memory goes and which tables it reads
_BACKBONE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "rope_theta",
                   "norm_eps")
_PLACEMENT_FIELDS = ("placement", "placement_k", "placement_n", "layer_indices", "sharing", "sharing_k")


def validate_upscale(c, base) -> None:
  """Rejects `c` as an up-scaling of `base` (the config of train.upscale_from's run) with one ConfigError naming the
  field and the fix, unless `c` is the base model with memory inserted that leaves its outputs unchanged: the same
  backbone; memory at every memory layer of the base, of its kind and fields, each reading what it read
  (`base_tables`); no inserted hml block reading a trained table, none before layer 0 copying the block before it;
  and train.freeze_base only over a base without memory (its memory layers would train with the inserted ones)."""
  source = f"the base run {c.train.upscale_from}"
  for f in _BACKBONE_FIELDS:
    if c.model[f] != base.model[f]:
      _fail(f"model.{f}", f"{c.model[f]!r}, and {source} has {base.model[f]!r}",
            f"set model.{f}={base.model[f]!r}: up-scaling inserts memory into the base model as it is")
  layers, base_layers = memory_layers(c), memory_layers(base)
  inserted = sorted(set(layers) - set(base_layers))
  if c.memory.kind == "hml" and c.train.upscale_copy == "previous" and inserted and inserted[0] == 0:
    _fail(_placement_field(c), "inserts an hml block before layer 0 with train.upscale_copy='previous': no block "
          "precedes it to copy", "insert at layers >= 1, or use train.upscale_copy='next'")
  if not base_layers:
    return
  if c.train.freeze_base:
    _fail("train.freeze_base", f"True, and {source} has memory ({base.memory.kind} at layers {base_layers}), which "
          "would train with the inserted memory (the groups memory and bank)", "up-scale without "
          "train.freeze_base, or from a run without memory")
  missing = sorted(set(base_layers) - set(layers))
  if missing:
    _fail(_placement_field(c), f"places no memory at layers {missing}, where {source} has it",
          "place memory at every memory layer of the base run, and at the layers to insert")
  for f in ("kind", *(f for f in base.memory if f not in _PLACEMENT_FIELDS)):  # the kind first: it explains the rest
    if c.memory[f] != base.memory[f]:
      _fail(f"memory.{f}", f"{c.memory[f]!r}, and {source} has {base.memory[f]!r}",
            f"set memory.{f}={base.memory[f]!r}: the base run's memory layers are kept as they are")
  pairs = base_tables(c, base)
  merged = sorted(t for t, n in collections.Counter(t for t, _ in pairs).items() if n > 1)
  if merged:
    _fail("memory.sharing", f"{c.memory.sharing!r} would merge tables of {source} into table(s) {merged}",
          "use memory.sharing='per_layer'")
  reading = sorted(i for i in inserted if bank_ids(c)[layers.index(i)] in {t for t, _ in pairs})
  if c.memory.kind == "hml" and reading:
    _fail("memory.sharing", f"{c.memory.sharing!r}: the hml blocks inserted at layers {reading} would read the "
          f"trained value table of {source}, so they would not start as the identity",
          "use memory.sharing='per_layer' (each inserted block a zero table of its own)")


def _logical_dims(c) -> dict[str, list[tuple[str, int]]]:
  """(field, size) of every dimension each logical axis names, for the mesh divisibility check."""
  m, mem = c.model, c.memory
  dims = {"vocab": [("model.vocab_size", m.vocab_size)], "embed": [("model.d_model", m.d_model)],
          "heads": [("model.num_heads", m.num_heads)], "kv": [("model.num_kv_heads", m.num_kv_heads)],
          "mlp": [("model.mlp_dim", m.mlp_dim)], "layers": [("model.num_layers", layer_plan(c).num_groups)]}
  if "train" in c:
    dims["batch"] = [("train.batch_size", c.train.batch_size)]
  if mem.enabled and memory_layers(c) and mem.kind == "ffn":
    dims["bank_embed"] = [("model.d_model", m.d_model)]
    dims["banks"] = [("memory.sharing", max(bank_ids(c)) + 1)]
  elif mem.enabled and memory_layers(c) and mem.kind != "chapters":
    value_dim = (mem.pkm_value_dim or m.d_model) if mem.kind == "pkm" else m.d_model // m.num_heads
    dims["value_embed"] = [("memory.pkm_value_dim", value_dim)]
    dims["banks"] = [("memory.sharing", max(bank_ids(c)) + 1)]
  elif mem.enabled and memory_layers(c):
    dims["embed"].append(("memory.dim", mem.dim or m.d_model))
    dims["heads"].append(("memory.num_heads", mem.num_heads))
    dims["kv"].append(("memory.num_kv_heads", mem.num_kv_heads))
    dims["chapter_tokens"] = [("memory.num_tokens", mem.num_tokens // mem.num_chapters)]
    dims["bank_embed"] = [("memory.dim", mem.dim or m.d_model)]
    dims["chapter_logits"] = [("memory.num_chapters", mem.num_chapters)]
    if mem.router == "product":
      dims["chapter_factors"] = [("memory.num_chapters", n) for n in router_factors(c)]
    dims["banks"] = [("memory.sharing", max(bank_ids(c)) + 1)]
  return dims
