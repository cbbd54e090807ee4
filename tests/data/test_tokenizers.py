"""Tokenizers: byte-level ids and round trip; HF and SentencePiece tokenizers trained offline here."""
import pytest

from moc_jax.errors import ConfigError, DataError
from moc_jax.data.tokenizers import _char_offsets_from_bytes, get_tokenizer

def test_byte_ids_and_round_trip():
  tok = get_tokenizer("byte")
  assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id, tok.eot_id) == (260, 256, 257, 258, 259)
  text = "Grüße, 世界! \n\t"
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8")) and max(ids) < 256
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, *ids, tok.eot_id, tok.eos_id, tok.pad_id]) == text  # specials are not text


def test_byte_offsets_are_character_spans():
  ids, offsets = get_tokenizer("byte").encode_with_offsets("aé")
  assert ids == [97, 0xC3, 0xA9] and offsets == [(0, 1), (1, 2), (1, 2)]


def test_char_offsets_from_bytes():
  # "aé b": bytes a=0, é=1..3, ' '=3, b=4
  assert _char_offsets_from_bytes("aé b", [(0, 1), (1, 3), (2, 3), (3, 5), (0, 0)]) == [
      (0, 1), (1, 2), (1, 2), (2, 4), (0, 0)]


def test_hf_tokenizer(hf_path):
  tok = get_tokenizer(f"hf:{hf_path}")
  assert tok.vocab_size == 300
  assert tok.eos_id == 0 and tok.pad_id == tok.eos_id and tok.bos_id == tok.eos_id  # SmolLM2-style fallbacks
  assert tok.eot_id == 2
  text = "Héllo world, cats and dogs"
  ids = tok.encode(text)
  assert len(ids) < len(text) and tok.decode(ids) == text
  ids, offsets = tok.encode_with_offsets("<|im_end|>world")
  assert ids[0] == tok.eot_id and offsets[0] == (0, 10)


def test_sentencepiece_tokenizer(sp_path):
  tok = get_tokenizer(f"sp:{sp_path}")
  assert tok.vocab_size == 60
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
  assert tok.eot_id == 4  # the user-defined <|im_end|> piece
  text = "Héllo world about cats"
  assert tok.decode(tok.encode(text)) == text
  ids, offsets = tok.encode_with_offsets("é<|im_end|>")
  assert tok.eot_id in ids and offsets[ids.index(tok.eot_id)] == (1, 11)


@pytest.mark.parametrize("spec, words", [
    ("hf:/nonexistent/tokenizer.json", ["/nonexistent/tokenizer.json", "backend_tokenizer.save"]),
    ("sp:/nonexistent/tok.model", ["/nonexistent/tok.model", "SentencePieceTrainer"]),
    ("wordpiece", ["'wordpiece'", "hf:"]),
])
def test_bad_tokenizer_spec_raises_data_error(spec, words):
  with pytest.raises(DataError) as e:
    get_tokenizer(spec)
  for w in words:
    assert w in str(e.value)


def test_a_tokenizer_larger_than_the_embedding_is_refused(hf_path, tmp_path):
  """A 300-id tokenizer on the tiny model's 260 embedding rows: refused by name and number, before training
  builds anything (the run would otherwise read garbage rows and end in NaN); 300 rows accept it."""
  import moc_jax
  from moc_jax import main as main_lib
  from moc_jax.data.tokenizers import model_tokenizer
  config = moc_jax.load_config("configs/moc.py:tiny", {"data.tokenizer": f"hf:{hf_path}"})
  message = "has 300 ids but config.model.vocab_size is 260 — set --config.model.vocab_size=300"
  with pytest.raises(ConfigError, match=message):
    model_tokenizer(config)
  with pytest.raises(ConfigError, match=message):
    main_lib.train(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "config.json").exists()
  bigger = moc_jax.load_config("configs/moc.py:tiny", {"data.tokenizer": f"hf:{hf_path}", "model.vocab_size": 300})
  assert model_tokenizer(bigger).vocab_size == 300


def _facts_corpus(style, **sizes):
  from moc_jax.config import data_config
  from moc_jax.data.facts import MocFactsConfig, generate
  c = data_config().facts
  c.update(style=style, num_entities=64, num_docs=400, num_val_docs=40, **sizes)
  return generate(MocFactsConfig.for_sizes(c))


def test_facts_tokenizer_spends_a_token_on_a_word_and_a_syllable_on_a_name():
  """A biography by hand: 3 + 3 syllables, the colon, 9 clauses of key, value and separator (the employer's value is
  two words): 35 tokens for 152 bytes. Bytes keep ids 0..255 and the specials 256..259, as in ByteTokenizer."""
  tok = get_tokenizer("facts")
  text = ("Corfenbel Rinjofen: sport fencing; plays flute; food goulash; colour violet; employer Ivorygate Labs; "
          "job locksmith; year 1926; city Pinewick; pet rabbit.")
  pieces = [tok._tok.id_to_token(i) for i in tok.encode(text)]
  clauses = [piece for clause in text.split(": ")[1].rstrip(".").split("; ")
             for piece in ["▁" + w for w in clause.split()] + [";"]]
  assert pieces == ["Cor", "fen", "bel", "▁Rin", "jo", "fen", ":", *clauses[:-1], "."]
  assert len(pieces) == 35 and tok.decode(tok.encode(text)) == text
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.eot_id) == (256, 257, 258, 259) and tok.vocab_size == 754
  assert tok.encode("é\n") == [0xC3, 0xA9, 0x0A]  # outside the vocabulary: its UTF-8 bytes
  assert tok.decode([tok.bos_id, *tok.encode("x"), tok.eos_id, tok.pad_id]) == "x"  # specials are not text


@pytest.mark.parametrize("style", ["biography", "mixed"])
def test_facts_tokenizer_round_trips_and_a_probe_answer_is_its_document_tokens(style):
  """Every text moc_facts writes decodes to itself; a probe's prompt then its answer are the tokens of the two
  together (the scorer encodes them apart), and every value word is one token after a space."""
  from moc_jax.data.facts import ATTRIBUTES
  tok = get_tokenizer("facts")
  corpus = _facts_corpus(style)
  for split in ("train", "validation", "paraphrase", "probes"):
    for example in corpus[split]:
      assert tok.decode(tok.encode(example["text"])) == example["text"]
  for p in corpus["probes"]:
    assert tok.encode(f"{p['prompt']} {p['answer']}") == tok.encode(p["prompt"]) + tok.encode(f" {p['answer']}")
  for values, _, _ in ATTRIBUTES.values():
    for value in values:
      assert len(tok.encode(f" {value}")) == len(value.split()), value
  for text in ("Grüße, 世界! \n\t  x ", "  two  spaces ", "<0x41> is not a byte token", "<unk> a <b", ""):
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("<|im_end|>") == [tok.eot_id]  # a special's name is the special, as in HF tokenizers
