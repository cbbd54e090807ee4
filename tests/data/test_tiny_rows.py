"""`make run`'s rows hold whole documents: with `tiny`'s config no moc_facts fact is cut in two by a row boundary
(packed 128-token rows cut a third of its sentences, the entity's name on one side and the value on the other)."""
import moc_jax
from moc_jax.data import make_eval_batches
from moc_jax.data.facts import MocFactsConfig, generate
from moc_jax.data.tokenizers import get_tokenizer


def test_no_tiny_document_is_longer_than_a_row_or_crosses_one(tmp_path):
  data = moc_jax.load_config("configs/moc.py:tiny", {"data.data_dir": str(tmp_path)}).data
  tokenizer = get_tokenizer(data.tokenizer)
  corpus = generate(MocFactsConfig.for_sizes(data.facts))
  for split in ("train", "validation", "paraphrase"):
    longest = max(len(tokenizer.encode(doc["text"])) + 1 for doc in corpus[split])  # + the EOS packing appends
    assert longest <= data.seq_len, split
  # One pass over the training documents as the pipeline lays them out: every document is one segment of one row.
  texts, seen = sorted(doc["text"] for doc in corpus["train"]), []
  for batch in make_eval_batches(data, split="train"):
    for ids, segments in zip(batch["input_ids"], batch["segment_ids"]):
      for s in range(1, segments.max() + 1):
        piece = ids[segments == s]
        assert piece[-1] == tokenizer.eos_id and (piece[:-1] != tokenizer.eos_id).all()
        seen.append(tokenizer.decode(piece[:-1].tolist()))
  assert sorted(seen) == texts
