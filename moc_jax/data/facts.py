"""`moc_facts`: a synthetic knowledge corpus generated locally, so memory layers can be studied without downloads.

Fictional entities (names built from syllables) get one value per attribute (birth city, birth year,
profession, ...); entities are drawn Zipf(a) across documents (a = 0: uniformly). What a document holds is the
corpus's `style`:
  mixed       2-4 facts about one entity, each through a paraphrase template: a few entities are seen
              thousands of times and most rarely or never — the long tail a memory bank should help with
              (`order=stream`: the entities in turn, each in a block of as many documents: a stream of new facts);
  biography   every attribute of one entity in a compact line ("Talo Venrik: job baker; city Aldergate; ..."),
              in a random order, short enough for one row: with many documents per entity, a store sized
              by its bits of facts (`fact_bits`) against what a backbone can hold.
A curriculum (`warmup_entities`, `warmup_docs`): the first training documents name only the first few entities,
written in order so that, read in order, a model learns to look facts up on few entities before it meets them all;
with `ramp_docs`, the next documents name a set of entities that grows geometrically from those few to all of them,
so that the way to look facts up, learnt on few, is not lost on meeting thousands at once.
Splits:
  train       documents rendered with the attribute's training templates;
  validation  held-out documents about the same facts, rendered with the training templates (new
              combinations of facts), so validation loss falls as the facts are learnt;
  paraphrase  held-out documents in a held-out paraphrase (one template per attribute never used in
              train): recall of facts through wording the model has never seen;
  probes      per fact a cloze `prompt` ("Talo Venrik was born in") whose continuation is " " + `answer`, with
              `num_candidates` candidates (the answer exactly once + distractors of the same attribute),
              `entity_rank` (1 = most frequent) and `doc_count` (train documents about the entity).
Every split shares one feature dict (a TFDS constraint); fields a split does not use are empty.
Everything is a pure function of the config (sizes + seed), and each config is cached under its own name.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import random

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from moc_jax.data.cache_lock import exclusive
from moc_jax.errors import DataError

_SYLLABLES = ("ka", "lo", "ven", "dra", "mi", "tor", "sel", "bra", "ni", "quo", "ral", "fen", "zu", "mar", "tis",
              "ol", "ber", "cy", "dun", "el", "gra", "hal", "jo", "kel", "lis", "mor", "nat", "pel", "rin", "sa",
              "tu", "var", "wen", "yor", "ash", "bel", "cor", "dal", "eth", "fal")
_PLACE_HEADS = ("Alder", "Bracken", "Cask", "Dun", "Elm", "Fen", "Glen", "Hollow", "Iron", "Juniper",
                "Kestrel", "Lark", "Marsh", "North", "Oak", "Pine", "Quill", "Raven", "Stone", "Thorn")
_PLACE_TAILS = ("gate", "hold", "wick", "mere", "ford", "haven", "bury", "moor")
_COMPANY_HEADS = ("Amberline", "Bluecrest", "Copperfield", "Deepwater", "Evergreen", "Foxglove", "Goldleaf",
                  "Highpoint", "Ivorygate", "Jadestone")
_COMPANY_TAILS = ("Labs", "Mills", "Systems")

# attribute -> (values, training templates, held-out validation template). Every template ends in
# "{value}." so its prefix is a cloze prompt; professions and pets start with a consonant ("a {value}").
ATTRIBUTES = {
    "birth_city": (
        tuple(h + _PLACE_TAILS[i % 8] for i, h in enumerate(_PLACE_HEADS))
        + tuple(h + _PLACE_TAILS[(i + 3) % 8] for i, h in enumerate(_PLACE_HEADS)),
        ("{name} was born in {value}.", "The birthplace of {name} is {value}.", "{name} grew up in {value}.",
         "The home town of {name} is {value}."),
        "{name} is a native of {value}."),
    "birth_year": (
        tuple(str(y) for y in range(1900, 2000)),
        ("{name} was born in the year {value}.", "The birth year of {name} is {value}.",
         "{name} came into the world in {value}.", "The year {name} was born was {value}."),
        "{name}'s year of birth is {value}."),
    "profession": (
        ("baker", "carpenter", "chemist", "dentist", "farmer", "fisherman", "geologist", "jeweller", "journalist",
         "lawyer", "librarian", "locksmith", "mechanic", "nurse", "painter", "pharmacist", "photographer", "pilot",
         "plumber", "potter", "sculptor", "surgeon", "tailor", "teacher", "translator", "veterinarian", "weaver",
         "zoologist", "cartographer", "botanist"),
        ("{name} works as a {value}.", "By trade, {name} is a {value}.", "The profession of {name} is {value}.",
         "{name} earns a living as a {value}."),
        "{name} has a job as a {value}."),
    "employer": (
        tuple(f"{h} {t}" for h in _COMPANY_HEADS for t in _COMPANY_TAILS),
        ("{name} is employed by {value}.", "The employer of {name} is {value}.", "{name} works for {value}.",
         "{name} draws a salary from {value}."),
        "{name} holds a position at {value}."),
    "colour": (
        ("red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "grey", "teal",
         "maroon", "violet", "indigo", "amber", "crimson", "turquoise", "beige", "lavender"),
        ("{name}'s favourite colour is {value}.", "The favourite colour of {name} is {value}.",
         "{name} likes no colour more than {value}.", "Asked for a colour, {name} always picks {value}."),
        "The colour {name} prefers is {value}."),
    "instrument": (
        ("piano", "violin", "cello", "flute", "clarinet", "trumpet", "guitar", "harp", "oboe", "drums",
         "saxophone", "banjo", "accordion", "trombone", "viola", "mandolin", "harmonica", "bassoon", "ukulele",
         "xylophone"),
        ("{name} plays the {value}.", "The instrument of {name} is the {value}.", "{name} practises the {value}.",
         "{name} is a keen player of the {value}."),
        "{name} performs music on the {value}."),
    "sport": (
        ("tennis", "football", "rowing", "fencing", "archery", "cycling", "swimming", "skiing", "climbing", "golf",
         "hockey", "rugby", "cricket", "volleyball", "badminton", "judo", "sailing", "running", "boxing", "curling"),
        ("{name}'s favourite sport is {value}.", "The sport {name} loves is {value}.",
         "In free time, {name} enjoys {value}.", "{name} is passionate about {value}."),
        "The favourite sport of {name} is {value}."),
    "food": (
        ("soup", "dumplings", "pancakes", "lentils", "risotto", "noodles", "curry", "porridge", "omelettes",
         "salad", "pie", "stew", "tacos", "sushi", "waffles", "goulash", "paella", "lasagne", "couscous", "chowder"),
        ("{name}'s favourite dish is {value}.", "The dish {name} likes most is {value}.",
         "For dinner, {name} always asks for {value}.", "{name} never tires of eating {value}."),
        "The favourite food of {name} is {value}."),
    "pet": (
        ("cat", "dog", "parrot", "tortoise", "rabbit", "hamster", "goldfish", "ferret", "lizard", "canary", "goat",
         "pony", "hedgehog", "budgie", "tarantula"),
        ("{name} owns a {value}.", "The pet of {name} is a {value}.", "{name} lives with a pet {value}.",
         "At home, {name} keeps a {value}."),
        "{name} takes care of a pet {value}."),
}
_ATTRS = tuple(ATTRIBUTES)
NUM_TRAIN_TEMPLATES = 4
STYLES = ("mixed", "biography")
ORDERS = ("shuffled", "stream")
# biography: each attribute's key in the compact line; "{name}: {key}" is the attribute's cloze prompt
BIOGRAPHY_KEYS = {"birth_city": "city", "birth_year": "year", "profession": "job", "employer": "employer",
                  "colour": "colour", "instrument": "plays", "sport": "sport", "food": "food", "pet": "pet"}

# The `facts` tokenizer's word mark (moc_jax.data.tokenizers): a piece that starts with it follows a space.
WORD_MARK = "\u2581"
_PUNCTUATION = (":", ";", ".", ",", "'s", "'")


def vocabulary() -> tuple[str, ...]:
  """Every piece moc_facts writes, in a fixed order: the pieces of the `facts` tokenizer, which spends one token on a
  value, a key or a template word instead of a byte each (a biography of about 150 bytes is about 35 tokens, so a
  reading of it costs about a sixth of the byte-level FLOPs). Names are syllables (each capitalized, after a space or
  not, and in lower case inside a name); every other word is whole, after a space (WORD_MARK), and a template's
  first word also without it (a text's start, where no space precedes it); WORD_MARK alone is a space before a space
  or at a text's end. Anything else is spelt in bytes."""
  words, openers = [BIOGRAPHY_KEYS[a] for a in _ATTRS], []
  for values, templates, held_out in ATTRIBUTES.values():
    words += [w for v in values for w in v.split()]
    for template in (*templates, held_out):
      text = template.replace("{name}", " ").replace("{value}", " ")
      for mark in _PUNCTUATION:
        text = text.replace(mark, " ")
      words += text.split()
      if not template.startswith("{name}"):
        openers.append(template.split()[0].rstrip(","))
  syllables = [s.capitalize() for s in _SYLLABLES]
  pieces = [WORD_MARK, *syllables, *(WORD_MARK + s for s in syllables), *_SYLLABLES, *_PUNCTUATION,
            *(WORD_MARK + w for w in words), *openers]
  return tuple(dict.fromkeys(pieces))  # first occurrence kept: the order is the code's


@dataclasses.dataclass(kw_only=True)
class MocFactsConfig(tfds.core.BuilderConfig):
  """Corpus sizes and seed. No defaults here: `config.data.facts` (config/schema.py) is their one home, and
  `for_sizes` builds this from it, naming the config after the sizes so each gets its own cache dir."""

  num_entities: int
  seed: int
  zipf_a: float
  num_docs: int
  num_val_docs: int
  probes_per_fact: int
  num_candidates: int
  style: str
  order: str
  warmup_entities: int
  warmup_docs: int
  ramp_docs: int

  @classmethod
  def for_sizes(cls, facts) -> "MocFactsConfig":
    fields = dict(facts)
    name = ("e{num_entities}_d{num_docs}_v{num_val_docs}_z{zipf_a}_s{seed}_p{probes_per_fact}"
            "_c{num_candidates}").format(**fields)
    if fields["style"] != "mixed":  # the mixed corpus keeps the cache name it always had
      name += f"_{fields['style']}"
    if fields["order"] != "shuffled":  # and the shuffled one too
      name += f"_{fields['order']}"
    if fields["warmup_docs"]:
      name += "_w{warmup_entities}x{warmup_docs}".format(**fields)
    if fields["ramp_docs"]:
      name += "_r{ramp_docs}".format(**fields)
    return cls(name=name, description="moc_facts with " + name, **fields)


def fact_bits(facts) -> dict:
  """The information the corpus's facts hold: every attribute value is drawn uniformly from its pool, so an
  entity's facts are Σ_a log2 |pool_a| bits (about 43). {per_entity, entities: those named by at least one
  training document, total: bits of the facts training states}; a backbone stores about 1-2 bits per parameter
  at best (Allen-Zhu & Li, "Physics of Language Models, Part 3.3")."""
  cfg = MocFactsConfig.for_sizes(facts)
  _check(cfg)
  per_entity = sum(math.log2(len(values)) for values, _, _ in ATTRIBUTES.values())
  picks = _picks(cfg, "train", cfg.num_docs)
  entities = len(set(picks))
  return {"per_entity": per_entity, "entities": entities, "total": per_entity * entities}


def _check(cfg: MocFactsConfig):
  smallest = min(len(values) for values, _, _ in ATTRIBUTES.values())
  checks = [
      ("num_entities", 1 <= cfg.num_entities <= 200_000, "use 1..200000"),
      ("num_docs", cfg.num_docs >= 1, "use >= 1"),
      ("num_val_docs", cfg.num_val_docs >= 1, "use >= 1"),
      ("zipf_a", cfg.zipf_a >= 0, "use >= 0 (0: every entity equally often)"),
      ("style", cfg.style in STYLES, f"use one of {list(STYLES)}"),
      ("order", cfg.order in ORDERS, f"use one of {list(ORDERS)}"),
      ("num_docs", cfg.order != "stream" or cfg.num_docs % cfg.num_entities == 0,
       f"use a multiple of num_entities={cfg.num_entities} with order='stream' (as many documents per entity)"),
      ("probes_per_fact", 1 <= cfg.probes_per_fact <= (NUM_TRAIN_TEMPLATES if cfg.style == "mixed" else 1),
       "use 1..4 (biography: 1, its one prompt per attribute)"),
      ("num_candidates", 2 <= cfg.num_candidates <= smallest, f"use 2..{smallest}"),
      ("warmup_entities", 0 <= cfg.warmup_entities <= cfg.num_entities,
       f"use 0..num_entities={cfg.num_entities} (the entities the first warmup_docs documents name)"),
      ("warmup_docs", 0 <= cfg.warmup_docs <= cfg.num_docs, f"use 0..num_docs={cfg.num_docs}"),
      ("warmup_docs", (cfg.warmup_docs == 0) == (cfg.warmup_entities == 0),
       "give both warmup_docs and warmup_entities, or neither (0 and 0: no curriculum)"),
      ("warmup_docs", cfg.warmup_docs == 0 or cfg.order == "shuffled",
       "use 0 with order='stream' (a stream is its own order)"),
      ("ramp_docs", cfg.ramp_docs == 0 or cfg.warmup_docs > 0,
       "use 0 without a curriculum (the ramp grows the set from warmup_entities: give warmup_docs too)"),
      ("ramp_docs", 0 <= cfg.ramp_docs <= cfg.num_docs - cfg.warmup_docs,
       f"use 0..num_docs - warmup_docs={cfg.num_docs - cfg.warmup_docs}"),
  ]
  for field, ok, fix in checks:
    if not ok:
      raise DataError(f"config.data.facts.{field}={getattr(cfg, field)!r} is invalid: {fix}")


def _entity_names(rng, n):
  names, seen = [], set()
  while len(names) < n:
    first = "".join(rng.choices(_SYLLABLES, k=rng.randint(2, 3))).capitalize()
    last = "".join(rng.choices(_SYLLABLES, k=rng.randint(2, 3))).capitalize()
    if (name := f"{first} {last}") not in seen:
      seen.add(name)
      names.append(name)
  return names


def _documents(rng, entities, values, picks, templates_for):
  """(entity index, text) per picked entity: 2-4 distinct attributes, each through a random template."""
  docs = []
  for e in picks:
    sentences = []
    for a in rng.sample(range(len(_ATTRS)), rng.randint(2, 4)):
      template = rng.choice(templates_for(_ATTRS[a]))
      sentences.append(template.format(name=entities[e], value=values[e][a]))
    docs.append((e, " ".join(sentences)))
  return docs


def _biographies(rng, entities, values, picks):
  """(entity index, text) per picked entity: all of its attributes as `key value` clauses in a random order,
  so each attribute follows the name directly in some documents (the form of its probe) and not in others."""
  docs = []
  for e in picks:
    order = rng.sample(range(len(_ATTRS)), len(_ATTRS))
    docs.append((e, biography(entities[e], [(_ATTRS[a], values[e][a]) for a in order])))
  return docs


def biography(name: str, facts) -> str:
  """The biography line of entity `name` holding `facts` [(attribute, value)] in the order given."""
  return f"{name}: " + "; ".join(f"{BIOGRAPHY_KEYS[attr]} {value}" for attr, value in facts) + "."


def entity_biographies(probes) -> dict[str, str]:
  """{entity: a biography of it} from a biography corpus's probes, one per attribute of each entity. Every training
  document about an entity holds the same words as this one (its attributes in another order), so whatever reads a
  text as a bag of words (a cluster tree's embedding) reads each of them as it reads this."""
  facts: dict[str, dict[str, str]] = collections.defaultdict(dict)
  for p in probes:
    facts[p["entity"]][p["attribute"]] = p["answer"]
  return {name: biography(name, sorted(of.items())) for name, of in facts.items()}


def _rngs(cfg):
  """The corpus's random streams (names, values, train, validation, probes). Python's Random is stable across
  platforms for str seeds and much faster than numpy for scalar draws."""
  return [random.Random(f"moc_facts/{cfg.seed}/{stream}") for stream in range(5)]


def _picks(cfg, split, n, rng=None):
  """The entity of each of a split's `n` documents: Zipf(a) over entity ranks (index i: rank i+1), the first
  warmup_docs of the training split's over the first warmup_entities ranks only (the curriculum), the next ramp_docs
  over the first _ramp_entities ranks; the training split of a `stream` corpus holds n / num_entities documents of
  entity 0, then as many of entity 1, ..."""
  if cfg.order == "stream" and split == "train":
    return [e for e in range(cfg.num_entities) for _ in range(n // cfg.num_entities)]
  weights = list(itertools.accumulate(r ** -cfg.zipf_a for r in range(1, cfg.num_entities + 1)))
  rng = rng or _rngs(cfg)[{"train": 2, "validation": 3}[split]]
  warmup, ramp = (cfg.warmup_docs, cfg.ramp_docs) if split == "train" else (0, 0)
  first = rng.choices(range(cfg.warmup_entities), cum_weights=weights[:cfg.warmup_entities], k=warmup) if warmup else []
  # rng.choices over the first m ranks, drawn one at a time without slicing the weights (O(log m) a document)
  growing = [bisect.bisect(weights, rng.random() * weights[m - 1], 0, m - 1) for m in _ramp_entities(cfg, ramp)]
  return first + growing + rng.choices(range(cfg.num_entities), cum_weights=weights, k=n - warmup - ramp)


def _ramp_entities(cfg, ramp) -> list[int]:
  """The entities the i-th of the ramp's documents may name: the first floor(w * (N / w) ** ((i + 1) / ramp)), w the
  warm-up's entities and N all of them: a geometric growth (each entity added is read about as often as those before
  it were when they were new), the last document over all N."""
  w, total = cfg.warmup_entities, cfg.num_entities
  # the 1e-9 keeps a power that rounds a hair under a whole number (the last: w * (N / w) ** 1.0) from losing one
  return [min(total, math.floor(w * (total / w) ** ((i + 1) / ramp) + 1e-9)) for i in range(ramp)]


def generate(cfg: MocFactsConfig) -> dict:
  """The whole corpus as Python lists (deterministic in cfg): {train, validation, paraphrase, probes}."""
  _check(cfg)
  rng_names, rng_values, rng_train, rng_val, rng_probes = _rngs(cfg)
  entities = _entity_names(rng_names, cfg.num_entities)
  values = [[rng_values.choice(ATTRIBUTES[a][0]) for a in _ATTRS] for _ in entities]
  train_picks = _picks(cfg, "train", cfg.num_docs, rng_train)
  val_picks = _picks(cfg, "validation", cfg.num_val_docs, rng_val)
  if cfg.style == "biography":
    train = _biographies(rng_train, entities, values, train_picks)
    val = _biographies(rng_val, entities, values, val_picks)
  else:
    train = _documents(rng_train, entities, values, train_picks, lambda a: ATTRIBUTES[a][1])
    val = _documents(rng_val, entities, values, val_picks, lambda a: ATTRIBUTES[a][1])
  paraphrase = _documents(random.Random(f"moc_facts/{cfg.seed}/paraphrase"), entities, values, val_picks,
                          lambda a: (ATTRIBUTES[a][2],))
  doc_count = collections.Counter(e for e, _ in train)

  def doc_example(e, text):
    return {"text": text, "entity": entities[e], "entity_rank": e + 1, "doc_count": doc_count[e],
            "attribute": "", "prompt": "", "answer": "", "candidates": []}

  probes = []
  for e, name in enumerate(entities):
    for a, attr in enumerate(_ATTRS):
      pool, templates, _ = ATTRIBUTES[attr]
      answer = values[e][a]
      candidates = [answer] + rng_probes.sample([v for v in pool if v != answer], cfg.num_candidates - 1)
      rng_probes.shuffle(candidates)
      prompts = ([f"{name}: {BIOGRAPHY_KEYS[attr]}"] if cfg.style == "biography" else
                 [t[:t.index("{value}")].rstrip().format(name=name) for t in templates[:cfg.probes_per_fact]])
      for prompt in prompts:
        probes.append({"text": f"{prompt} {answer}", "entity": name, "entity_rank": e + 1,
                       "doc_count": doc_count[e], "attribute": attr, "prompt": prompt, "answer": answer,
                       "candidates": candidates})
  return {"train": [doc_example(e, t) for e, t in train],
          "validation": [doc_example(e, t) for e, t in val],
          "paraphrase": [doc_example(e, t) for e, t in paraphrase],
          "probes": probes}


class MocFacts(tfds.core.GeneratorBasedBuilder):
  """TFDS builder for `moc_facts` (no download; ArrayRecord output gives grain random access)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "validation uses the training templates; held-out wording moved to `paraphrase`."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    # TFDS's default probes `importlib_resources` (not installed here) for builders defined in a package.
    return epath.Path(__file__)

  def _info(self):
    text = tfds.features.Text()
    # TFDS writes the records in an order hashed from their keys; a stream and a curriculum keep generation order
    # (the pipeline reads it in order with data.shuffle=False), the other corpora the order they were always
    # written in
    in_order = self.builder_config.order == "stream" or self.builder_config.warmup_docs > 0  # a ramp needs one
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        disable_shuffling=in_order,
        features=tfds.features.FeaturesDict({
            "text": text, "entity": text, "entity_rank": np.int32, "doc_count": np.int32,
            "attribute": text, "prompt": text, "answer": text, "candidates": tfds.features.Sequence(text),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    corpus = generate(self.builder_config)
    return {split: self._generate_examples(examples) for split, examples in corpus.items()}

  def _generate_examples(self, examples):
    yield from enumerate(examples)


@contextlib.contextmanager
def _quiet_tfds():
  """TFDS warns on every builder made from a config object ("Using custom data configuration"); mute it."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


@contextlib.contextmanager
def _sorted_in_memory():
  """TFDS orders a split's examples by hashed key in memory up to `shuffle.MAX_MEM_BUFFER_SIZE` (1 GB of serialized
  examples) and beyond it spills them into hash-range buckets through `tf.io.gfile`: TensorFlow, which this project
  does not install, so a large corpus died after minutes of generating, in a traceback. The buckets are sorted ranges
  of the same keys, so the order, and the corpus, is the same either way: keep up to half this machine's memory in
  the buffer instead, and say so in one line where even that is too little."""
  from tensorflow_datasets.core import shuffle
  default = shuffle.MAX_MEM_BUFFER_SIZE
  shuffle.MAX_MEM_BUFFER_SIZE = max(default, _memory_bytes() // 2)
  try:
    yield
  except ModuleNotFoundError as e:
    if e.name != "tensorflow":
      raise
    limit = shuffle.MAX_MEM_BUFFER_SIZE / 2**30
    raise DataError(f"config.data.facts: the corpus's documents take more than {limit:.1f} GiB (half this machine's "
                    "memory) to put in order, and TFDS spills them to disk only through TensorFlow: generate it on a "
                    "machine with more memory, or lower data.facts.num_docs") from None
  finally:
    shuffle.MAX_MEM_BUFFER_SIZE = default


def _memory_bytes() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def facts_builder(facts, data_dir: str) -> MocFacts:
  """The prepared builder for `config.data.facts` (generated on first use; a file lock serialises processes)."""
  cfg = MocFactsConfig.for_sizes(facts)
  _check(cfg)
  with _quiet_tfds():
    builder = MocFacts(config=cfg, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
      with exclusive(os.path.join(data_dir, "moc_facts", f".{cfg.name}.lock")):
        builder = MocFacts(config=cfg, data_dir=data_dir, file_format="array_record")
        if not builder.is_prepared():
          with _sorted_in_memory():
            builder.download_and_prepare()
  return builder
