"""Tokenizers behind one small interface: byte-level (no files), HF `tokenizers` JSON, SentencePiece.

Every tokenizer encodes WITHOUT adding BOS/EOS (MoC-PT's GPT-2-style calls add none); the pipeline adds
separators itself. `encode_with_offsets` returns character spans so chat loss masks can follow MoC-PT's
rule "a token is labelled iff its span overlaps an assistant content span".
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from moc_jax.errors import ConfigError, DataError

Offsets = list[tuple[int, int]]


class Tokenizer:
  """Common interface. `spec` is the string it was built from; `fingerprint` identifies its vocabulary."""

  spec: str
  fingerprint: str
  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int
  eot_id: int  # end of turn (ChatML's <|im_end|> when the vocabulary has it)

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError

  def __repr__(self):
    return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size})"


def _char_offsets_from_bytes(text: str, byte_spans) -> Offsets:
  """Maps UTF-8 byte spans onto character spans of `text` (a span inside a character covers that character)."""
  char_start = np.cumsum([0] + [len(ch.encode("utf-8")) for ch in text])  # byte offset of each char
  spans = np.asarray(byte_spans, dtype=np.int64).reshape(-1, 2)
  starts = np.searchsorted(char_start, spans[:, 0], side="right") - 1
  ends = np.searchsorted(char_start, spans[:, 1], side="left")
  ends = np.where(spans[:, 1] > spans[:, 0], np.maximum(ends, starts + 1), starts)
  return [(int(s), int(e)) for s, e in zip(starts, ends)]


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes 0..255 plus pad 256, eos 257, bos 258, end-of-turn 259 (the tiny model's vocab of 260)."""

  spec = "byte"
  fingerprint = "byte"
  vocab_size = 260
  pad_id, eos_id, bos_id, eot_id = 256, 257, 258, 259

  def encode(self, text):
    return list(text.encode("utf-8"))

  def encode_with_offsets(self, text):
    ids, offsets = [], []
    for i, ch in enumerate(text):
      encoded = ch.encode("utf-8")
      ids.extend(encoded)
      offsets.extend([(i, i + 1)] * len(encoded))
    return ids, offsets

  def decode(self, ids):
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _file_fingerprint(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _require_file(path, kind, how):
  if not os.path.isfile(path):
    raise DataError(f"{kind} file {path!r} not found. {how}")


def _first_known(lookup, candidates, default=None):
  for token in candidates:
    token_id = lookup(token)
    if token_id is not None:
      return token_id
  return default


_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
_EOT_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


class HFTokenizer(Tokenizer):
  """A local HF `tokenizer.json`; special ids by their usual names (pad and bos fall back to eos, as in SmolLM2)."""

  def __init__(self, path):
    import tokenizers
    path = os.path.abspath(os.path.expanduser(path))
    _require_file(path, "HF tokenizer", "Save one with `AutoTokenizer.from_pretrained(name).backend_tokenizer"
                  ".save('tokenizer.json')` on a machine with network, or copy the model's tokenizer.json here.")
    self._bind(tokenizers.Tokenizer.from_file(path), f"hf:{path}", _file_fingerprint(path))

  def _bind(self, tok, spec, fingerprint):
    """Takes `tok` (a `tokenizers.Tokenizer`) and finds its special ids."""
    self._tok, self.spec, self.fingerprint = tok, spec, fingerprint
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    lookup = self._tok.token_to_id
    self.eos_id = _first_known(lookup, _EOS_NAMES)
    if self.eos_id is None:
      raise DataError(f"HF tokenizer {spec!r} has none of the end-of-sequence tokens {list(_EOS_NAMES)}")
    self.bos_id = _first_known(lookup, _BOS_NAMES, self.eos_id)
    self.pad_id = _first_known(lookup, _PAD_NAMES, self.eos_id)
    self.eot_id = _first_known(lookup, _EOT_NAMES, self.eos_id)

  def encode(self, text):
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_with_offsets(self, text):
    enc = self._tok.encode(text, add_special_tokens=False)
    return enc.ids, list(enc.offsets)

  def decode(self, ids):
    return self._tok.decode([int(i) for i in ids])


class FactsTokenizer(HFTokenizer):
  """moc_facts's words (moc_jax.data.facts.vocabulary), built in memory with no file: bytes 0..255 at ids 0..255
  (the fallback of any text outside the vocabulary) and the specials at 256..259 as in ByteTokenizer, then unk and
  one piece per word. A segmentation uses the fewest pieces (a unigram model of equal scores), so a biography
  costs about a quarter of its bytes in tokens; a space starts the next piece, so a probe's answer is the same
  tokens after its prompt as inside a document."""

  def __init__(self):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from moc_jax.data.facts import WORD_MARK, vocabulary
    specials = ["<pad>", "<eos>", "<s>", "<|im_end|>"]
    pieces = [(f"<0x{b:02X}>", 0.0) for b in range(256)] + [(t, 0.0) for t in specials]
    unk_id = len(pieces)
    pieces += [("<unk>", 0.0)] + [(piece, -1.0) for piece in vocabulary()]
    tok = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=unk_id, byte_fallback=True))
    # "<" alone: no text spells a byte's piece (<0x41>) or a special's; moc_facts never writes it
    words = pre_tokenizers.Metaspace(replacement=WORD_MARK, prepend_scheme="never")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("<", "isolated"), words])
    tok.decoder = decoders.Sequence([decoders.Replace(WORD_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    digest = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]  # pieces, scores, splitting and decoding
    self._bind(tok, "facts", f"facts-{digest}")


class SPTokenizer(Tokenizer):
  """A local SentencePiece `.model`; undefined pad/bos fall back to eos, end-of-turn to `<|im_end|>` or eos."""

  def __init__(self, path):
    import sentencepiece
    path = os.path.abspath(os.path.expanduser(path))
    _require_file(path, "SentencePiece model", "Copy the model's tokenizer.model here, or train one offline with "
                  "`sentencepiece.SentencePieceTrainer.train(input=corpus.txt, model_prefix=..., vocab_size=...)`.")
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.spec, self.fingerprint = f"sp:{path}", _file_fingerprint(path)
    self.vocab_size = self._sp.get_piece_size()
    if self._sp.eos_id() < 0:
      raise DataError(f"SentencePiece model {path!r} defines no eos id (train it with eos_id >= 0)")
    self.eos_id = self._sp.eos_id()
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else self.eos_id
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
    self.eot_id = _first_known(self._piece_id, _EOT_NAMES, self.eos_id)

  def _piece_id(self, piece):
    """The piece's id, or None when SentencePiece maps it to unk (not in the vocabulary)."""
    piece_id = self._sp.piece_to_id(piece)
    return None if piece_id == self._sp.unk_id() else piece_id

  def encode(self, text):
    return self._sp.encode(text)

  def encode_with_offsets(self, text):
    pieces = self._sp.encode(text, return_type="proto").pieces
    byte_spans = [(p.begin, p.end) for p in pieces]
    return [p.id for p in pieces], _char_offsets_from_bytes(text, byte_spans)

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids])


_CACHE: dict[str, Tokenizer] = {}


def get_tokenizer(spec: str) -> Tokenizer:
  """'byte' | 'facts' | 'hf:<tokenizer.json>' | 'sp:<model.model>' -> a (cached) Tokenizer."""
  if spec not in _CACHE:
    kind, _, path = spec.partition(":")
    if kind == "byte" and not path:
      _CACHE[spec] = ByteTokenizer()
    elif kind == "hf" and path:
      _CACHE[spec] = HFTokenizer(path)
    elif kind == "sp" and path:
      _CACHE[spec] = SPTokenizer(path)
    elif kind == "facts" and not path:
      _CACHE[spec] = FactsTokenizer()
    else:
      raise DataError(f"config.data.tokenizer: unknown spec {spec!r}; use 'byte', 'facts', "
                      "'hf:<path/tokenizer.json>' or 'sp:<path/model.model>'")
  return _CACHE[spec]


def model_tokenizer(config) -> Tokenizer:
  """`config.data.tokenizer`, checked against the model it feeds: every id it can produce needs an embedding
  row (an id past `model.vocab_size` reads garbage and the run ends in NaN, or crashes on an accelerator)."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(f"config.data.tokenizer {config.data.tokenizer!r} has {tokenizer.vocab_size} ids but "
                      f"config.model.vocab_size is {config.model.vocab_size} — set --config.model.vocab_size="
                      f"{tokenizer.vocab_size} (or more), or use the tokenizer the model was built for")
  return tokenizer
