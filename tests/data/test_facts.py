"""The moc_facts corpus: deterministic, Zipf long tail, held-out paraphrases, probes, per-config cache."""
import collections
import math
import os
import re

import numpy as np
import pytest

from moc_jax.config import data_config
from moc_jax.data import load_probes
from moc_jax.errors import DataError
from moc_jax.data.facts import (ATTRIBUTES, BIOGRAPHY_KEYS, MocFactsConfig, entity_biographies, fact_bits, facts_builder,
                                generate)


def tiny_facts(**overrides):
  facts = data_config().facts
  facts.update({"num_entities": 60, "num_docs": 600, "num_val_docs": 40, **overrides})
  return facts


def _sentences(docs):
  return {s for d in docs for s in d["text"].split(". ")}


def test_generate_is_deterministic_and_seeded():
  cfg = MocFactsConfig.for_sizes(tiny_facts())
  assert generate(cfg) == generate(cfg)
  other = generate(MocFactsConfig.for_sizes(tiny_facts(seed=1)))
  assert other["train"] != generate(cfg)["train"]


def test_zipf_long_tail():
  corpus = generate(MocFactsConfig.for_sizes(tiny_facts(num_entities=500, num_docs=5000)))
  counts = np.bincount([d["entity_rank"] for d in corpus["train"]], minlength=501)[1:]
  assert counts[0] >= 20 * max(np.median(counts), 1)
  assert counts[:10].sum() > 0.3 * counts.sum()
  assert (counts <= 2).mean() > 0.3  # most entities are rare


def test_paraphrase_split_is_held_out_wording_of_the_same_facts():
  corpus = generate(MocFactsConfig.for_sizes(tiny_facts()))
  assert not _sentences(corpus["train"]) & _sentences(corpus["paraphrase"])
  for attr, (_, train_templates, val_template) in ATTRIBUTES.items():
    assert val_template not in train_templates and val_template.endswith("{value}."), attr
  facts = {(p["entity"], p["answer"]) for p in corpus["probes"]}
  for split in ("validation", "paraphrase"):
    for doc in corpus[split]:  # every value stated in held-out documents is the entity's true value
      stated = [v for values, _, _ in ATTRIBUTES.values() for v in values if f" {v}." in doc["text"] + " "]
      assert stated and all((doc["entity"], v) in facts for v in stated)


def test_validation_uses_training_wording_in_new_documents():
  corpus = generate(MocFactsConfig.for_sizes(tiny_facts()))
  train_docs = {d["text"] for d in corpus["train"]}
  facts = {(p["entity"], p["attribute"]): p["answer"] for p in corpus["probes"]}
  for doc in corpus["validation"]:
    allowed = {t.format(name=doc["entity"], value=facts[doc["entity"], a]).rstrip(".")
               for a, (_, templates, _) in ATTRIBUTES.items() for t in templates}
    assert {x.rstrip(".") for x in doc["text"].split(". ")} <= allowed, doc["text"]
  assert sum(d["text"] not in train_docs for d in corpus["validation"]) > 0.5 * len(corpus["validation"])


def test_probes(tmp_path):
  c = data_config()
  c.facts, c.data_dir = tiny_facts(probes_per_fact=2), str(tmp_path)
  probes = load_probes(c)
  assert len(probes) == 60 * len(ATTRIBUTES) * 2
  train_counts = collections.Counter(d["entity_rank"] for d in generate(MocFactsConfig.for_sizes(c.facts))["train"])
  for p in probes:
    assert p["candidates"].count(p["answer"]) == 1
    assert len(set(p["candidates"])) == len(p["candidates"]) == 4
    assert set(p["candidates"]) <= set(ATTRIBUTES[p["attribute"]][0])
    assert p["entity"] in p["prompt"] and not p["prompt"].endswith(" ")
    assert p["doc_count"] == train_counts[p["entity_rank"]]
  assert len({p["prompt"] for p in probes}) == len(probes)


def test_builder_is_deterministic_and_cached_per_config(tmp_path):
  facts = tiny_facts()
  a = facts_builder(facts, str(tmp_path / "a"))
  b = facts_builder(facts, str(tmp_path / "b"))
  for split in ("train", "validation", "paraphrase", "probes"):
    ra, rb = a.as_data_source(split), b.as_data_source(split)
    assert len(ra) == len(rb) and all(ra[i] == rb[i] for i in range(0, len(ra), 37))
  assert len(a.as_data_source("train")) == 600 and len(a.as_data_source("validation")) == 40
  other = facts_builder(tiny_facts(seed=3), str(tmp_path / "a"))
  assert other.data_dir != a.data_dir
  assert sorted(os.listdir(tmp_path / "a" / "moc_facts")) == sorted(
      [".e60_d600_v40_z1.1_s0_p1_c4.lock", ".e60_d600_v40_z1.1_s3_p1_c4.lock",
       "e60_d600_v40_z1.1_s0_p1_c4", "e60_d600_v40_z1.1_s3_p1_c4"])


def test_a_corpus_over_tfds_memory_buffer_is_ordered_in_memory_and_is_the_same_corpus(tmp_path, monkeypatch):
  """Past shuffle.MAX_MEM_BUFFER_SIZE TFDS spills examples to disk through TensorFlow, which is not installed: with
  the buffer cut to 1 kB this corpus (about 60 kB) would end in ModuleNotFoundError. It is generated, and record for
  record equal to the one ordered under TFDS's own 1 GB buffer."""
  from tensorflow_datasets.core import shuffle
  facts = tiny_facts()
  whole = facts_builder(facts, str(tmp_path / "whole"))
  monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)
  spilled = facts_builder(facts, str(tmp_path / "spilled"))
  assert shuffle.MAX_MEM_BUFFER_SIZE == 1000  # TFDS's limit is back as it was
  for split in ("train", "validation", "paraphrase", "probes"):
    ra, rb = whole.as_data_source(split), spilled.as_data_source(split)
    assert len(ra) == len(rb) and all(ra[i] == rb[i] for i in range(len(ra)))


def test_a_corpus_over_half_the_memory_is_one_error_line(tmp_path, monkeypatch):
  from moc_jax.data import facts as facts_module
  from tensorflow_datasets.core import shuffle
  monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)
  monkeypatch.setattr(facts_module, "_memory_bytes", lambda: 2000)
  with pytest.raises(DataError, match=r"config.data.facts: the corpus's documents take more than 0.0 GiB .* lower "
                     r"data.facts.num_docs"):
    facts_builder(tiny_facts(), str(tmp_path))


@pytest.mark.parametrize("field, value", [("num_candidates", 1), ("num_candidates", 50), ("probes_per_fact", 5),
                                          ("num_entities", 0)])
def test_invalid_facts_config(field, value, tmp_path):
  with pytest.raises(DataError, match=f"config.data.facts.{field}"):
    facts_builder(tiny_facts(**{field: value}), str(tmp_path))


def test_the_mixed_corpus_is_what_it_always_was():
  """The biography style and the uniform draw left the default corpus as it was: its bytes, pinned."""
  import hashlib
  import json
  corpus = generate(MocFactsConfig.for_sizes(tiny_facts()))
  assert hashlib.sha256(json.dumps(corpus, sort_keys=True).encode()).hexdigest()[:16] == "593296b6b9b2f0db"
  assert MocFactsConfig.for_sizes(tiny_facts()).name == "e60_d600_v40_z1.1_s0_p1_c4"


def biography(**overrides):
  return tiny_facts(**{"style": "biography", "zipf_a": 0.0, **overrides})


def test_fact_bits_by_hand():
  """Pools of 40 cities, 100 years, 30 professions, 30 employers, 20 colours, instruments, sports and foods,
  15 pets: log2 of their product per entity; only entities some training document names count."""
  per_entity = math.log2(40 * 100 * 30 * 30 * 20 ** 4 * 15)
  bits = fact_bits(biography(num_entities=50, num_docs=5000))
  assert bits["per_entity"] == pytest.approx(per_entity, rel=1e-12) and bits["entities"] == 50
  assert bits["total"] == pytest.approx(50 * per_entity, rel=1e-12)
  few = fact_bits(tiny_facts(num_entities=1000, num_docs=20))  # Zipf: 20 documents name at most 20 entities
  assert few["entities"] <= 20 and few["total"] == pytest.approx(few["entities"] * per_entity, rel=1e-12)


def test_biographies_hold_every_fact_in_one_row():
  """Every biography states all nine facts of its entity, fits a 256-token row with its EOS (byte tokens,
  the longest names and values), every entity gets about as many documents (zipf_a = 0), and each probe's
  prompt + answer is a clause some training document begins with."""
  corpus = generate(MocFactsConfig.for_sizes(biography(num_entities=200, num_docs=20_000, num_val_docs=200)))
  facts = {(p["entity"], p["attribute"]): p["answer"] for p in corpus["probes"]}
  for doc in corpus["train"] + corpus["validation"]:
    assert len(doc["text"].encode()) + 1 <= 256
    name, clauses = doc["text"].rstrip(".").split(": ", 1)
    stated = dict(c.split(" ", 1) for c in clauses.split("; "))
    assert stated == {BIOGRAPHY_KEYS[a]: facts[name, a] for a in ATTRIBUTES}
  counts = collections.Counter(d["entity"] for d in corpus["train"])
  assert len(counts) == 200 and max(counts.values()) < 1.5 * 100 and min(counts.values()) > 0.5 * 100
  openings = {d["text"].split("; ")[0] for d in corpus["train"]}
  assert all(f"{p['prompt']} {p['answer']}" in openings for p in corpus["probes"])
  assert len(corpus["probes"]) == 200 * len(ATTRIBUTES)


def test_the_biography_corpus_is_what_it_always_was():
  import hashlib
  import json
  corpus = generate(MocFactsConfig.for_sizes(biography(num_entities=50, num_docs=2000, num_val_docs=50)))
  assert hashlib.sha256(json.dumps(corpus, sort_keys=True).encode()).hexdigest()[:16] == "bea3b4c085bc04b6"


def test_an_entitys_biography_from_its_probes_holds_the_words_of_each_of_its_documents():
  """The same words, as often, as every training and validation document about the entity: what a bag-of-words
  reader (the cluster tree) sees of them all."""
  corpus = generate(MocFactsConfig.for_sizes(biography(num_entities=30, num_docs=600, num_val_docs=30)))
  texts = entity_biographies(corpus["probes"])
  assert len(texts) == 30

  def words(text):
    return collections.Counter(re.findall(r"\w+", text.lower()))

  for doc in corpus["train"] + corpus["validation"]:
    assert words(doc["text"]) == words(texts[doc["entity"]])


@pytest.mark.parametrize("field, value", [("style", "essay"), ("zipf_a", -1.0), ("probes_per_fact", 2)])
def test_bad_biography_fields_are_one_error(field, value):
  with pytest.raises(DataError, match=rf"config.data.facts.{field}="):
    generate(MocFactsConfig.for_sizes(biography(**{field: value})))


def test_a_stream_teaches_one_entity_per_block_of_documents():
  """order=stream: entity 0's 5 documents, then entity 1's, ...: each about its own entity; the other splits and
  the probes are the shuffled corpus's; a count that does not divide is refused by name."""
  corpus = generate(MocFactsConfig.for_sizes(tiny_facts(order="stream", num_docs=300)))
  ranks = [d["entity_rank"] for d in corpus["train"]]
  assert ranks == [e + 1 for e in range(60) for _ in range(5)]
  assert all(d["text"].count(d["entity"]) >= 2 for d in corpus["train"])  # 2-4 facts, each naming the entity
  shuffled = generate(MocFactsConfig.for_sizes(tiny_facts(num_docs=300)))
  assert corpus["probes"] == [{**p, "doc_count": 5} for p in shuffled["probes"]]
  assert corpus["validation"] == [{**d, "doc_count": 5} for d in shuffled["validation"]]
  with pytest.raises(DataError, match=r"config.data.facts.num_docs=301 is invalid: use a multiple of num_entities"):
    generate(MocFactsConfig.for_sizes(tiny_facts(order="stream", num_docs=301)))


def test_a_warmup_names_only_its_entities_first_and_leaves_the_rest_as_drawn():
  """warmup_docs=100 of warmup_entities=6: the first 100 training documents each name one of the first 6 entities
  (every one of them, uniformly: zipf_a = 0), the other 900 are the draw over all 60 that a corpus of 900 documents
  without the warm-up would make after those 100 draws of the same stream; bits count the entities named."""
  import random
  facts = biography(num_docs=1000, warmup_entities=6, warmup_docs=100)
  cfg = MocFactsConfig.for_sizes(facts)
  assert cfg.name == "e60_d1000_v40_z0.0_s0_p1_c4_biography_w6x100"
  ranks = [d["entity_rank"] for d in generate(cfg)["train"]]
  assert set(ranks[:100]) == set(range(1, 7)) and max(collections.Counter(ranks[:100]).values()) < 30
  stream = random.Random("moc_facts/0/2")
  first = stream.choices(range(6), k=100)
  assert [r - 1 for r in ranks] == first + stream.choices(range(60), k=900)
  assert fact_bits(facts)["entities"] == 60


def test_a_ramp_grows_the_named_entities_geometrically_from_the_warmups_to_all():
  """warmup 6 entities x 100 documents, then a ramp of 10: document i of the ramp names one of the first
  floor(6 * 10 ** ((i + 1) / 10)) entities (by hand: 7, 9, 11, 15, 18, 23, 30, 37, 47, 60), each drawn as
  rng.choices over them would, then the 890 others over all 60 (without a ramp: the warm-up test's draws)."""
  import random
  facts = biography(num_docs=1000, warmup_entities=6, warmup_docs=100, ramp_docs=10)
  cfg = MocFactsConfig.for_sizes(facts)
  assert cfg.name == "e60_d1000_v40_z0.0_s0_p1_c4_biography_w6x100_r10"
  ranks = [d["entity_rank"] - 1 for d in generate(cfg)["train"]]
  stream = random.Random("moc_facts/0/2")
  first = stream.choices(range(6), k=100)
  ramp = [stream.choices(range(m))[0] for m in (7, 9, 11, 15, 18, 23, 30, 37, 47, 60)]
  assert ranks == first + ramp + stream.choices(range(60), k=890)
  # a longer ramp over a Zipf corpus: never past its bound, from about the warm-up's 6 to the last entities
  zipf = MocFactsConfig.for_sizes(tiny_facts(num_docs=3000, warmup_entities=6, warmup_docs=100, ramp_docs=2000))
  ramped = [d["entity_rank"] for d in generate(zipf)["train"]][100:2100]
  bounds = [math.floor(6 * 10 ** ((i + 1) / 2000) + 1e-9) for i in range(2000)]
  assert all(r <= b for r, b in zip(ramped, bounds)) and max(ramped[:200]) <= 7 and max(ramped[-200:]) > 50


@pytest.mark.parametrize("overrides, problem", [
    ({"warmup_entities": 61, "warmup_docs": 10}, r"warmup_entities=61 is invalid: use 0..num_entities=60"),
    ({"warmup_entities": 6, "warmup_docs": 601}, r"warmup_docs=601 is invalid: use 0..num_docs=600"),
    ({"warmup_entities": 6}, r"warmup_docs=0 is invalid: give both warmup_docs and warmup_entities, or neither"),
    ({"warmup_docs": 10}, r"warmup_docs=10 is invalid: give both"),
    ({"warmup_entities": 6, "warmup_docs": 10, "order": "stream"}, r"warmup_docs=10 is invalid: use 0 with order"),
    ({"ramp_docs": 10}, r"ramp_docs=10 is invalid: use 0 without a curriculum"),
    ({"warmup_entities": 6, "warmup_docs": 10, "ramp_docs": 591}, r"ramp_docs=591 is invalid: use 0..num_docs - w"),
])
def test_a_bad_warmup_is_one_error(overrides, problem):
  with pytest.raises(DataError, match=rf"config.data.facts.{problem}"):
    generate(MocFactsConfig.for_sizes(tiny_facts(**overrides)))


def test_a_warmup_needs_the_documents_in_order():
  from moc_jax.config import validate_data
  data = data_config()
  data.facts.update(warmup_entities=6, warmup_docs=10)
  with pytest.raises(DataError, match=r"config.data.shuffle: True would spread .*set data.shuffle=False"):
    validate_data(data)
  data.shuffle = False
  validate_data(data)
