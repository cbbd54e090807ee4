"""The capacity-bound fact store: `--config=configs/capacity.py:NAME`, and the sweeps `python -m
experiments.capacity` runs (get_sweep below: preflight, gate, lr, arms, confirm).

Does a memory pay where the dense model runs out of room? Compact biographies (data.facts.style=biography: all nine
attributes of one entity in one line of 133 to 183 bytes with its EOS, so a 192-token row of whole documents holds
one and never two: 79% of the slots scored, as with pad_truncate's rows; 256-token rows score 59%), entities drawn
uniformly (zipf_a = 0), each read DOCS_PER_ENTITY times in one pass, against a backbone too small to hold them.

The study's default (experiments/capacity.py DEFAULT_CONFIG: `moc,words,entities=8192,readings=400,ramp=25600`) is
the size whose gate passed at untuned rates (docs/results/2026-11-30-capacity-gate-d32.md; at the narrow backbone's
searched rate it does not: docs/results/2026-12-02-capacity-study-part2.md): the biographies in the `facts`
tokenizer's words (36-token rows), 8,192 entities x 42.97 bits = 352.0 kbit of facts, each entity read 400 times,
against the d 32
narrow backbone (24,736 parameters without the tied embedding: 14.2 bits of facts per parameter; it takes them up in
words, not in bytes) and the d 64 wide one (98,624: 3.57); memories of about 66k parameters (SHAPES["facts"]); the
iso-FLOP dense model SwiGLU 272. So far over capacity, twice the readings add little recall to a backbone that is full
(the gate's plateau check); at 3.57 bits per parameter the d 64 backbone still gained +0.055
(docs/results/2026-11-29-capacity-gate-words.md); two more model seeds rose +0.031 and +0.033, so the size is at
the check's edge. A narrow run is 102,400 updates, 17.8 min on the 2-core AMD EPYC alone; the study about 44 narrow
runs, about 13 h (the record has the step ratios).

Sizing in bytes, the earlier default (count_params, moc_jax.data.facts.fact_bits, moc_jax.flops;
tests/experiments/test_capacity.py checks the ratios of both):

  facts     42.97 bits per entity (Σ log2 of the nine value pools) x 4,096 entities = 176.0 kbit
  narrow    d 64, 2 layers, 4 heads (2 KV), SwiGLU 192: 98,624 parameters without the tied embedding (115,264 with
            it): 1.78 bits of facts per parameter
  wide      d 128, 8 heads (4 KV), SwiGLU 384 (the gate's): 393,856 (427,136): 0.45 bits per parameter
  memories  each about 2.7x the narrow backbone, read by both layers: a bank of 257 chapters x 16 tokens at d 64
            (263,168; top-4, 1,576,483 model FLOPs per token), a pkm table of 64^2 slots x 64 (262,144; top-8, 2 heads;
            1,293,820) or two hml tables of 91^2 x 16 (264,992; 1,517,452); fetched by the cluster path (TREE): the same
            bank, 2 chapters a document (1,256,016), or FFN memory of 1,184 columns x 3 x 64 (227,328; 1,135,948)
  iso       the narrow backbone at SwiGLU 432 (190,784 without the embedding: 0.92 bits per parameter), 1,593,028
            FLOPs per token: +1.05% on the costliest memory arm, the bank

A transformer stores at most about 2 bits of such facts per parameter, about 1 after 100 exposures (Allen-Zhu & Li,
"Physics of Language Models, Part 3.3"): the narrow backbone cannot hold the facts and the wide one can, with room
to spare. Every run reads WARM_ENTITIES entities first (the curriculum without which the uptake of facts is a
lottery over seeds: docs/results/2026-11-28-capacity-curriculum.md). Whether the readings teach the narrow backbone
facts at all, where it has room, is what the preflight measures: the same readings of PREFLIGHT_ENTITIES entities.

Time. A run is one pass: 204,800 documents, 6,400 steps of 32 rows = 39.3M row slots. On the 2-core AMD EPYC this was
sized on, a narrow step took 0.2 s alone and 0.28 s beside another run (two runs at once share the cores, no faster
together): 0.36 h a run alone. The others relative to it, measured (docs/results/2026-11-29-capacity-step-cost.md,
±20%; their FLOPs say less for the memories): wide 2.2x, iso 1.3x, MoC 2.9x, hml 2.9x, FFN 1.9x, pkm 1.7x, cluster
1.6x (12.4 for the six arms). In narrow runs: preflight 0.18 (1,144 steps); gate 1.1 (the narrow run and its
cool-down at half its steps) + 2.2 = 3.3; arms, the lr
sweep 3 rates (its search's fewest) x a quarter x 12.4 = 9.3 and the runs 12.4; confirm 3 seeds x (at most 2.9 +
1.3) = 12.6: 38 narrow runs, about 14 h, evaluations (4,096 probes, about 20 s each, 5 a run) adding about an hour;
but its preflight
recalls 0.772 of the 0.9 the gate needs: 50 readings do not teach the backbone even 256 entities. At the readings
that do (400 per entity, the `bound` modifier: 8x the steps; its preflight recalls 1.000; both in
docs/results/2026-11-29-capacity-preflight.md) the study in bytes (`moc,bound,ramp=12800`) is about 114 h on this
CPU, over the 8 h it was meant to fit, its gate about 9.5 h (preflight 0.2, narrow 2.8 and its cool-down 0.3,
wide 6.2),
run in parts: each run resumes from its last of CHECKPOINTS checkpoints. Rows per update do not buy speed here: a
step of 32, 64 or 128 rows costs about the same per row (11.9 to 12.2 ms for the narrow backbone, 25 to 29 for MoC,
beside two training runs: the preflight record's `step_ratio` command). In words (`NAME,words`) a step costs a
seventh of that for the narrow backbone, a quarter for the wide, a half for MoC, and 100 readings teach the narrow
backbone most of 4,096 entities' facts (docs/results/2026-11-29-capacity-words.md).

NAME: `moc` (the study's base and its MoC arm: routed + prefix + attention pooling, causal), `dense` (the narrow
backbone), `wide`, `preflight`, `iso` (the iso-FLOP dense model: SwiGLU widened to the model FLOPs per token of the
costliest memory arm, every bank projection its routing computes included), and `pkm`, `hml` where the schema has
`memory.kind`; `NAME,bound`: the same at BOUND_DOCS_PER_ENTITY readings per entity; `NAME,entities=N`: N entities
instead of ENTITIES, the readings per entity kept (the steps scale with N: `moc,bound,entities=2048` is half the
`bound` study's steps at 0.89 bits of facts per narrow parameter); `NAME,readings=N`: N readings per entity (the
steps scale with N; `readings=400` is `bound`);
`NAME,warm=N`: the first WARMUP_STEPS updates about N entities only instead of WARM_ENTITIES (`warm=0`: no
curriculum); `NAME,ramp=N`: the N updates after those about a set of entities growing geometrically from the
curriculum's to all of them instead of all at once (a shorter run of a sweep has a ramp as long in proportion);
`NAME,words`: the same documents in the `facts` tokenizer's words (moc_jax.data.tokenizers) instead of bytes: rows
of WORD_ROW tokens instead of 192, 754 ids instead of 260, and the models of SHAPES["facts"]; `NAME,narrow=D`: the
narrow backbone of width D that SHAPES sizes in the representation (words: 32, the default, or 16, whose wide backbone
is the d 32 one), with its wide backbone, memories and rate (its gate at 6,144 and 6,912 entities fails by a probe
and by the floor: docs/results/2026-12-06-capacity-gate-n16.md).
"""
from moc_jax.config import schema, sibling

moc = sibling(__file__, "moc")

ENTITIES = 4096
DOCS_PER_ENTITY = 50
# The `bound` modifier (`configs/capacity.py:NAME,bound`): the readings per entity at which a narrow backbone takes
# these facts up (docs/results/2026-11-28-capacity-levers.md; the d 64 one at 2,048 entities was still taking them up
# at 200: 2026-11-28-capacity-curriculum.md), so that the gate can tell room from exposure.
BOUND_DOCS_PER_ENTITY = 400
# The `words` modifier's rows (data.tokenizer=facts): a biography is at most 35 words and marks (a name of at most 6
# syllables, its colon, 9 clauses of key, value and separator, the employer's two words) and its EOS; at least 33,
# so two never share a row either.
WORD_ROW = 36
BATCH = 32                  # rows (documents) per update
EVALS = 4                   # evaluations after step 0 along a run of the config's steps: the learning curve
CHECKPOINTS = 16            # along a run: an interrupted run (a run of the `bound` size takes hours) loses at most 1/16
PREFLIGHT_ENTITIES = 256
# The curriculum (`warm=N`, WARM_ENTITIES without it): the first WARMUP_STEPS updates (a quarter of a shorter run's)
# read documents about N entities only, the rest are drawn over all of them. Recall waits on a plateau whose length
# varies from seed to seed and grows with the entities; few entities first shorten it (Zucchet et al. 2025, "How do
# language models learn facts?"): docs/results/2026-11-28-capacity-curriculum.md.
WARMUP_STEPS = 800
WARM_ENTITIES = 64
# The gate's plateau check: the narrow run's recall against that of the run of this share of its steps, measured in
# the same run (train.cooldowns: its decay costs a tenth of the narrow run, where a run of its own cost half).
GATE_COOLDOWN = 0.5
# The rungs of the rate searches (sweeps `gate_lr` and `lr`), in multiples of each model's own rate (SHAPES `lr`; the
# wide backbone's half of it), in the order a search may reach them: the harness runs a model at the first two, then
# one rung further while its best is at the end of what it has run (experiments/capacity.py lr_search), so that the
# rate it picks has a worse one on either side. A grid of three fixed rungs costs as much, and left MoC's and the
# iso-FLOP model's best at its lowest (docs/results/2026-12-02-capacity-study-part2.md).
LR_MULTIPLES = (1, 1 / 3, 3, 1 / 9, 9, 1 / 27)
LR_STEPS = 0.25  # ... each trained for this share of the steps
SEEDS = (0, 1, 2)           # `confirm`: model seeds, each on its own corpus, data.facts.seed = seed + 1 (corpus 0
                            # is the one the gate and the arms ran on, so the confirmation is on corpora nothing chose)
NO_MEMORY = moc.NO_MEMORY
# The models of each representation (data.tokenizer: `byte`, or `facts` with the `words` modifier). The narrow
# backbone (2 layers) is the smallest measured that takes the facts up reliably in those tokens, at its rate `lr`; the
# wide one is twice its width (4x the parameters) at half the rate: Adam's step on a hidden matrix should shrink as its
# width grows (muP), and the gate must not handicap either model with the other's rate. Each memory is about 2.7x the
# narrow backbone's parameters (`arms`: the sizes an arm changes), read by both layers.
SHAPES = {
    # d 64: its uptake is reliable over seeds with the curriculum (docs/results/2026-11-28-capacity-curriculum.md);
    # d 32 stayed at chance on 1,024 entities (docs/results/2026-11-29-capacity-backbone.md). A bank of 257 chapters
    # x 16 tokens; pkm 64^2 slots x 64; hml two tables of 91^2 x 16; the cluster arm the same bank; FFN memory 1,370
    # columns of 3 x 64 split evenly between the levels (1370 // 32 = 42 per level-0 node, 1370 // 512 = 2 per leaf:
    # 1,184 columns, 44 fetched per token).
    "byte": {64: {
        "lr": 5e-3,
        "narrow": {"model.d_model": 64, "model.num_heads": 4, "model.num_kv_heads": 2, "model.mlp_dim": 192},
        "wide": {"model.d_model": 128, "model.num_heads": 8, "model.num_kv_heads": 4, "model.mlp_dim": 384},
        "memory": {"memory.num_tokens": 257 * 16, "memory.num_chapters": 257, "memory.num_heads": 4,
                   "memory.num_kv_heads": 4},
        "pkm": {"memory.pkm_sub_keys": 64, "memory.pkm_key_dim": 64},
        "arms": {"hml": {"memory.pkm_sub_keys": 91},
                 "ffn": {"memory.cluster_chapters": (42, 2), "memory.num_chapters": 1184}}}},
    "facts": {
        # d 32 takes the facts up in words (1,024 entities after 200 readings: 0.929; 256 after 400: 1.000:
        # docs/results/2026-11-30-capacity-gate-d32.md). A bank of 129 chapters x 16 tokens; pkm 45^2 slots x 32; hml
        # two tables of 45^2 x 16; the cluster arm 257 chapters (one per leaf) x 8 tokens; FFN memory 688 columns of
        # 3 x 32 split evenly between the levels (688 // 32 = 21 per level-0 node, 688 // 512 = 1 per leaf: 592).
        32: {"lr": 1e-2,
             "narrow": {"model.d_model": 32, "model.num_heads": 2, "model.num_kv_heads": 1, "model.mlp_dim": 96},
             "wide": {"model.d_model": 64, "model.num_heads": 4, "model.num_kv_heads": 2, "model.mlp_dim": 192},
             "memory": {"memory.num_tokens": 129 * 16, "memory.num_chapters": 129, "memory.num_heads": 2,
                        "memory.num_kv_heads": 2},
             "pkm": {"memory.pkm_sub_keys": 45, "memory.pkm_key_dim": 32},
             "arms": {"hml": {"memory.pkm_sub_keys": 45},
                      "cluster": {"memory.num_chapters": 257, "memory.num_tokens": 257 * 8},
                      "ffn": {"memory.cluster_chapters": (21, 1), "memory.num_chapters": 592}}},
        # `narrow=16`: d 16 learns 256 entities from 400 readings (preflight recall 0.996 at 1e-2), and after 100
        # readings of 8,192 entities recalls 0.311 at 1.11e-3 and 0.308 at 3.33e-3 (d 32: 0.446 and 0.410), about 0.3
        # of d 32's facts held (docs/results/2026-12-06-capacity-gate-n16.md): a fact store of a third the size
        # sits as far over its capacity, in a third of the steps. Its rate search starts between those two rates;
        # its wide backbone is the d 32 one. A bank of 65 chapters x 16 tokens; pkm 32^2 slots x 16; hml two tables
        # of 32^2 x 8; the cluster arm 257 chapters x 4 tokens; FFN memory 336 columns of 3 x 16 (5 per level-0
        # node, 1 per leaf: 5 x 16 + 256).
        16: {"lr": 1e-2 / 3,
             "narrow": {"model.d_model": 16, "model.num_heads": 2, "model.num_kv_heads": 1, "model.mlp_dim": 48},
             "memory": {"memory.num_tokens": 65 * 16, "memory.num_chapters": 65, "memory.num_heads": 2,
                        "memory.num_kv_heads": 2},
             "pkm": {"memory.pkm_sub_keys": 32, "memory.pkm_key_dim": 16},
             "arms": {"hml": {"memory.pkm_sub_keys": 32},
                      "cluster": {"memory.num_chapters": 257, "memory.num_tokens": 257 * 4},
                      "ffn": {"memory.cluster_chapters": (5, 1), "memory.num_chapters": 336}}}},
}
SHAPES["facts"][16]["wide"] = SHAPES["facts"][32]["narrow"]  # d 16's wide backbone is the d 32 study's narrow one
# The narrow backbone's width of each representation when the config names none (`narrow=D`).
NARROW = {"byte": 64, "facts": 32}
# The arms that fetch memory by the document's path (data/cluster_paths.py): a 16-ary tree of 2 levels, 256 leaves
# over the entities (16 a leaf at 4,096 if the tree finds them). They tell a router's failure from the bank's: a bank
# read by what the document is about instead of by a learned router.
TREE = {"data.cluster.k": 16, "data.cluster.levels": 2, "memory.routing": "cluster", "memory.routing_pool": "mean"}
# Memory arms: the overrides of the base config (itself the MoC arm) and the memory.kind each needs; an arm joins
# the study when the schema knows its kind. Their sizes are the representation's (SHAPES).
MEMORY_ARMS = {
    "moc": ({"memory.load_balance": "routed", "memory.routing": "prefix", "memory.routing_pool": "attention"},
            "chapters"),
    "pkm": ({"memory.kind": "pkm"}, "pkm"),
    # MIDUS: a table per memory block, its values a head wide (16)
    "hml": ({"memory.kind": "hml", "memory.sharing": "per_layer"}, "hml"),
    # the shared chapter and one per leaf (each document reads 2)
    "cluster": ({**TREE, "memory.cluster_chapters": (0, 1)}, "chapters"),
    # FFN memory in the bank's parameters, as columns of the MLP fetched by the path
    "ffn": ({**TREE, "memory.kind": "ffn", "memory.num_shared": 0}, "ffn"),
    # the cluster arm's bank fetched by the subject's path: the tree reads a text's first two words, a biography's
    # name, so a question takes the path of its entity's documents (on the whole-text tree 27% of prompts reach
    # their entity's leaf) and the path itself tells nothing of the facts (the whole-text path alone recalls 0.387
    # where chance is 0.25: docs/results/2026-12-07-capacity-arms-r800.md): a pure test of what the bank stores
    "subject": ({**TREE, "data.cluster.words": 2, "memory.cluster_chapters": (0, 1)}, "chapters"),
}
SIZED_LIKE = {"subject": "cluster"}  # an arm whose memory has another arm's sizes (SHAPES' "arms")


def shapes(c) -> dict:
  """SHAPES of `c`'s representation and narrow backbone (`c` is a study's base, whose width is the narrow one's)."""
  return SHAPES[c.data.tokenizer][c.model.d_model]


def wide(c) -> dict:
  """The overrides that make `c`'s backbone the wide one: twice the width at half the rate."""
  lr = shapes(c)["lr"] / 2
  return {**NO_MEMORY, **shapes(c)["wide"], "train.base_lr": lr, "train.memory_lr": lr}


def memory_arms(c) -> dict:
  """The MEMORY_ARMS whose memory.kind this schema has (`chapters` always: a schema without memory.kind has only it),
  each with its sizes in `c`'s representation."""
  sizes = shapes(c)["arms"]
  return {name: {**MEMORY_ARMS[name][0], **sizes.get(SIZED_LIKE.get(name, name), {})} for name in _arm_names()}


def _arm_names() -> list[str]:
  kinds = getattr(schema, "MEMORY_KINDS", ("chapters",))
  return [name for name, (_, kind) in MEMORY_ARMS.items() if kind in kinds]


def _study(c, docs_per_entity=DOCS_PER_ENTITY, entities=ENTITIES, warm=0, ramp=0, words=False, narrow=None):
  """The base: the narrow backbone (`narrow` wide, the representation's NARROW if None) with the MoC arm's memory,
  the pkm / hml sizes where the schema has them, the biography corpus of `entities` entities, one pass over it
  (docs_per_entity readings of each), its first updates about `warm` entities only (0: no curriculum), the `ramp`
  updates after them about a set growing from those to all; in bytes, or in the `facts` tokenizer's words with
  `words`."""
  c.model.update(vocab_size=260, max_seq_len=192, num_layers=2)
  # 192-token rows of whole documents: every biography fits one with its EOS, and two never share one.
  c.data.update(tokenizer="byte", seq_len=192, layout="pack_whole")
  if words:
    from moc_jax.data.tokenizers import get_tokenizer
    c.data.update(tokenizer="facts", seq_len=WORD_ROW)
    c.model.update(vocab_size=get_tokenizer("facts").vocab_size, max_seq_len=WORD_ROW)
  c.update_from_flattened_dict(SHAPES[c.data.tokenizer][narrow or NARROW[c.data.tokenizer]]["narrow"])
  c.memory.update(num_shared=1, top_k=4, layer_indices=(0, 1))
  c.update_from_flattened_dict(shapes(c)["memory"])
  c.update_from_flattened_dict(memory_arms(c)["moc"])
  if "kind" in c.memory:
    c.memory.update(pkm_top_k=8, pkm_heads=2)
    c.update_from_flattened_dict(shapes(c)["pkm"])
  c.data.facts.update(style="biography", zipf_a=0.0, num_entities=entities, num_docs=entities * docs_per_entity,
                      num_val_docs=512)
  steps = entities * docs_per_entity // BATCH
  if warm:  # written first and read in order (the documents are written in a random order of entities)
    c.data.facts.update(warmup_entities=warm, warmup_docs=_curriculum_docs(steps, BATCH), ramp_docs=ramp * BATCH)
    c.data.shuffle = False
  # The bank's rows are read rarely, so weight decay would erase what they hold between reads (PKM practice).
  lr = shapes(c)["lr"]
  c.train.update(batch_size=BATCH, decay_start_ratio=0.8, base_lr=lr, memory_lr=lr, bank_weight_decay=0.0,
                 log_every=50, eval_batches=None, num_probes=4096)
  c.update_from_flattened_dict(_schedule(steps))
  return c


def _schedule(steps) -> dict:
  """A run of `steps` updates, its warm-up, evaluations (the learning curve) and checkpoints in proportion: a shorter
  run of a sweep (the `lr` sweep's quarter, the preflight) has a schedule of its own, not the full
  run's cut short."""
  return {"train.steps": steps, "train.warmup_steps": max(1, steps // 32), "train.eval_every": max(1, steps // EVALS),
          "train.checkpoint_every": max(1, steps // CHECKPOINTS)}


def _curriculum_docs(steps, batch) -> int:
  """The documents the curriculum's updates read: WARMUP_STEPS updates, or a quarter of a shorter run's."""
  return min(WARMUP_STEPS, steps // 4) * batch


def _shorter(c, steps) -> dict:
  """The overrides that make `c` a run of `steps` updates: its schedule, and its curriculum if it has one (a ramp
  as long in proportion)."""
  facts = c.data.facts
  if not facts.warmup_entities:
    return _schedule(steps)
  ramp = {"data.facts.ramp_docs": facts.ramp_docs * steps // c.train.steps} if facts.ramp_docs else {}
  return {**_schedule(steps), "data.facts.warmup_docs": _curriculum_docs(steps, c.train.batch_size), **ramp}


def _preflight(c) -> dict:
  """The narrow backbone on PREFLIGHT_ENTITIES entities (an eighth of the config's, if fewer), each read as often as
  in the config: its curriculum, then as many readings of each entity as the config's (at least 32 updates), about
  a thirteenth of the steps at the `bound` size. Do these readings teach the backbone these facts where it has room to
  spare? It reads as many entities first as the config does, or all of them if fewer."""
  facts, batch = c.data.facts, c.train.batch_size
  entities = min(PREFLIGHT_ENTITIES, max(1, facts.num_entities // 8))
  warm = facts.warmup_docs  # 0 without a curriculum
  docs = max(32 * batch, warm + entities * ((facts.num_docs - warm) // facts.num_entities))
  ramp = {"data.facts.ramp_docs": facts.ramp_docs * docs // facts.num_docs} if facts.ramp_docs else {}
  capped = {"data.facts.warmup_entities": min(facts.warmup_entities, entities), **ramp} if warm else {}
  return {**NO_MEMORY, "data.facts.num_entities": entities, "data.facts.num_docs": docs, **capped,
          **_schedule(docs // batch)}


def _with(c, overrides):
  out = c.copy_and_resolve_references()
  out.update_from_flattened_dict(overrides)
  return out


def _iso(c) -> dict:
  """The iso-FLOP dense model: the backbone, SwiGLU widened to the model FLOPs per token of the costliest memory arm
  (moc_jax.flops.model_flops_per_token: every bank projection its routing computes, once per micro-batch where the
  micro-batch shares it; configs/moc.py's sizing). One dense model for every arm: a cheaper arm that beats it beats a
  dense model of more FLOPs than its own."""
  from moc_jax.flops import model_flops_per_token
  costliest = max((_with(c, arm) for arm in memory_arms(c).values()), key=model_flops_per_token)
  return {**NO_MEMORY, "model.mlp_dim": moc._iso_mlp_dim(costliest, costliest.memory.top_k)}


def _arms(c) -> list[dict]:
  """Every memory arm, and the iso-FLOP dense model."""
  return [*memory_arms(c).values(), _iso(c)]


def _lr(c, model) -> list[dict]:
  """`model` (overrides) at each rung of LR_MULTIPLES, in multiples of its own rates (`c`'s where it sets none)."""
  base = {k: model.get(f"train.{k}", c.train[k]) for k in ("base_lr", "memory_lr")}
  return [{**model, **{f"train.{k}": float(f"{m * v:.3g}") for k, v in base.items()}} for m in LR_MULTIPLES]


def _searched(c, models) -> list[dict]:
  """Each of `models` at each rung for LR_STEPS of the steps: where its rate is chosen (the harness runs the rungs
  its search needs)."""
  steps = _shorter(c, max(1, int(c.train.steps * LR_STEPS)))
  return [{**p, **steps} for model in models for p in _lr(c, model)]


def _gate_models(c) -> list[dict]:
  """The gate's narrow backbone and its backbone at twice the width."""
  return [dict(NO_MEMORY), wide(c)]


def _gate(c):
  """The narrow backbone, evaluated also as the run of half its steps would have ended (its cool-down there: does
  doubling the exposures still add recall?), and the wide one, each at each rung (the harness runs each at the rate
  the `gate_lr` runs chose: neither backbone's plateau is its rate's)."""
  narrow, wide_ = _gate_models(c)
  return [*_lr(c, {**narrow, "train.cooldowns": (GATE_COOLDOWN,)}), *_lr(c, wide_)]


def _arms_sweep(c):
  """Each arm at each rate, the config's steps (the harness runs each arm at the rate the `lr` sweep chose)."""
  return [p for arm in _arms(c) for p in _lr(c, arm)]


def _confirm(c):
  """The `arms` points once per seed of SEEDS, each seed on its own corpus (the harness runs the arms
  experiments/capacity.py choose_confirmed chooses, at their rates)."""
  return [{**p, "data.facts.seed": s + 1, "seed": s, "data.seed": s} for s in SEEDS for p in _arms_sweep(c)]


SWEEPS = {"preflight": lambda c: [_preflight(c)], "gate_lr": lambda c: _searched(c, _gate_models(c)), "gate": _gate,
          "lr": lambda c: _searched(c, _arms(c)), "arms": _arms_sweep,
          "confirm": _confirm}


def get_sweep(name, config):
  """Sweep `name` of `config` (the base, `moc`, at the harness's size): a list of {dotted field: value} overrides."""
  if name not in SWEEPS:
    raise ValueError(f"unknown sweep {name!r}; known: {sorted(SWEEPS)}")
  return SWEEPS[name](config)


def _models() -> dict:
  """NAME -> the overrides of the base that make it, as a function of the base."""
  out = {"moc": lambda c: {}, "dense": lambda c: NO_MEMORY, "wide": wide,
         "preflight": _preflight, "iso": _iso}
  for name in _arm_names():
    out[name] = lambda c, name=name: memory_arms(c)[name]
  return out


def _count(mods, key, default, least) -> int:
  """The `key=N` modifier's N (`default` without it), one line naming the modifier and the least N where it is bad."""
  given = [m for m in mods if m.startswith(f"{key}=")]
  if not given:
    return default
  n = given[-1].removeprefix(f"{key}=")
  if len(given) > 1 or not n.isdigit() or int(n) < least:
    example = {"warm": "`configs/capacity.py:moc,readings=200,entities=2048,warm=64`",
               "ramp": "`configs/capacity.py:dense,readings=100,ramp=3200`"}.get(
        key, "`configs/capacity.py:moc,bound,entities=1024` or `...:moc,readings=800,entities=512`")
    raise ValueError(f"config modifiers {sorted(given)}: give one `{key}=N`, N a whole number of at least {least}"
                     f"{' at these readings per entity' if key == 'entities' else ''} (e.g. {example})")
  return int(n)


def _readings(mods) -> int:
  """The readings of each entity: DOCS_PER_ENTITY, BOUND_DOCS_PER_ENTITY with `bound`, or N with `readings=N` (the
  gate at `readings=800` asks whether 800 readings hold more than its cool-down at half the steps, 400)."""
  if "bound" in mods and any(m.startswith("readings=") for m in mods):
    raise ValueError("config modifiers: give `bound` (400 readings per entity) or `readings=N`, not both")
  return _count(mods, "readings", BOUND_DOCS_PER_ENTITY if "bound" in mods else DOCS_PER_ENTITY, 1)


def _entities(mods, docs_per_entity) -> int:
  """The `entities=N` modifier's N (ENTITIES without it): the same readings per entity over N entities, the steps
  scaled with them, for sizes between the preflight's and the study's."""
  least = -(-BATCH * 32 // docs_per_entity)  # 32 steps: one of warm-up (steps // 32), checkpoints 2 apart
  return _count(mods, "entities", ENTITIES, least)


def _default_warm(entities) -> int:
  """WARM_ENTITIES where the corpus has more entities than that, else no curriculum (too few to single some out)."""
  return WARM_ENTITIES if entities > WARM_ENTITIES else 0


def _warm(mods, entities) -> int:
  """The `warm=N` modifier's N (_default_warm without it; 0: no curriculum): the entities the first WARMUP_STEPS
  updates read, fewer than all."""
  warm = _count(mods, "warm", _default_warm(entities), 0)
  if warm >= entities:
    raise ValueError(f"config modifier `warm={warm}`: give fewer entities than the corpus's {entities} (e.g. "
                     "`warm=64`; `warm=0` or none: no curriculum)")
  return warm


def _ramp(mods, warm, steps) -> int:
  """The `ramp=N` modifier's N (0 without it): the updates after the curriculum's whose entities grow from its `warm`
  to all of them."""
  ramp = _count(mods, "ramp", 0, 0)
  if ramp and not warm:
    raise ValueError(f"config modifier `ramp={ramp}`: a ramp grows the curriculum's entities to all of them; leave "
                     f"out `warm=0` (without it the curriculum reads the first {WARM_ENTITIES})")
  room = steps - _curriculum_docs(steps, BATCH) // BATCH
  if ramp > room:
    raise ValueError(f"config modifier `ramp={ramp}`: give at most the {room} updates after the curriculum's "
                     "(e.g. `ramp=3200`)")
  return ramp


def _narrow(mods, tokenizer) -> int:
  """The `narrow=D` modifier's D (the representation's NARROW without it): a width SHAPES sizes in that
  representation."""
  widths = sorted(SHAPES[tokenizer])
  given = [m.removeprefix("narrow=") for m in mods if m.startswith("narrow=")]
  if not given:
    return NARROW[tokenizer]
  if len(given) > 1 or not given[0].isdigit() or int(given[0]) not in widths:
    raise ValueError(f"config modifiers {sorted('narrow=' + g for g in given)}: give one `narrow=D`, D a width the "
                     f"study sizes in {'words' if tokenizer == 'facts' else 'bytes'}: {' or '.join(map(str, widths))}"
                     " (e.g. `configs/capacity.py:moc,words,narrow=16`)")
  return int(given[0])


def get_config(arg="moc"):
  models = _models()
  name, mods = schema.parse_arg(arg, models)
  unknown = {m for m in mods if m not in ("bound", "words")
             and not m.startswith(("entities=", "readings=", "warm=", "ramp=", "narrow="))}
  if unknown:
    raise ValueError(f"config arg {arg!r}: unknown modifiers {sorted(unknown)}; configs/capacity.py takes `bound`, "
                     "`words`, `readings=N`, `entities=N`, `warm=N`, `ramp=N` and `narrow=D` (e.g. "
                     "`configs/capacity.py:moc,bound,entities=1024`)")
  docs_per_entity = _readings(mods)
  entities = _entities(mods, docs_per_entity)
  warm = _warm(mods, entities)
  ramp = _ramp(mods, warm, entities * docs_per_entity // BATCH)
  narrow = _narrow(mods, "facts" if "words" in mods else "byte")
  base = _study(schema.base_config(), docs_per_entity, entities, warm, ramp, words="words" in mods, narrow=narrow)
  base.update_from_flattened_dict(models[name](base))
  readings = {DOCS_PER_ENTITY: "", BOUND_DOCS_PER_ENTITY: "-bound"}.get(docs_per_entity, f"-r{docs_per_entity}")
  base.name = (f"capacity-{name.replace('=', '-')}{readings}" + (f"-e{entities}" if entities != ENTITIES else "")
               + (f"-w{warm}" if warm != _default_warm(entities) else "") + (f"-ramp{ramp}" if ramp else "")
               + ("-words" if "words" in mods else "")
               + (f"-n{narrow}" if narrow != NARROW[base.data.tokenizer] else ""))
  return base
