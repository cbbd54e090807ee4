"""IFT chat rows: loss masks exactly on assistant content (plain = MoC-PT's format, chatml), via the pipeline."""
import json

import numpy as np
import pytest

from moc_jax.config import data_config
from moc_jax.data import make_eval_batches, make_train_iterator
from moc_jax.errors import DataError
from moc_jax.data.chat import chat_example
from moc_jax.data.tokenizers import get_tokenizer

BYTE = get_tokenizer("byte")
ROW = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo é"},
                    {"role": "user", "content": "Ok"}, {"role": "assistant", "content": "Bye"}]}


def _b(text):
  return list(text.encode("utf-8"))


def test_plain_format_matches_mocpt_fallback_and_masks_assistant_content():
  ids, labels = chat_example(ROW, BYTE, "plain")
  assert BYTE.decode(ids) == "<|user|>\nHi\n<|assistant|>\nYo é\n<|user|>\nOk\n<|assistant|>\nBye"
  expected = ([-100] * len(_b("<|user|>\nHi\n<|assistant|>\n")) + _b("Yo é")
              + [-100] * len(_b("\n<|user|>\nOk\n<|assistant|>\n")) + _b("Bye"))
  assert labels.tolist() == expected
  assert ids.dtype == labels.dtype == np.int32


def test_chatml_masks_assistant_content_and_its_end_of_turn():
  ids, labels = chat_example(ROW, BYTE, "chatml")
  eot = BYTE.eot_id
  expected_ids = (_b("<|im_start|>user\nHi") + [eot] + _b("\n<|im_start|>assistant\nYo é") + [eot]
                  + _b("\n<|im_start|>user\nOk") + [eot] + _b("\n<|im_start|>assistant\nBye") + [eot])
  expected_labels = ([-100] * (len(_b("<|im_start|>user\nHi")) + 1 + len(_b("\n<|im_start|>assistant\n")))
                     + _b("Yo é") + [eot]
                     + [-100] * (len(_b("\n<|im_start|>user\nOk")) + 1 + len(_b("\n<|im_start|>assistant\n")))
                     + _b("Bye") + [eot])
  assert ids.tolist() == expected_ids
  assert labels.tolist() == expected_labels


@pytest.mark.parametrize("chat_format", ["plain", "chatml"])
def test_row_without_assistant_trains_on_everything(chat_format):
  ids, labels = chat_example({"messages": [{"role": "user", "content": "only a question"}]}, BYTE, chat_format)
  assert labels.tolist() == ids.tolist()


@pytest.mark.parametrize("row", [None, "text", {}, {"messages": []}, {"messages": "hi"},
                                 {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": 3}]},
                                 {"messages": [["user", "hi"]]}])
def test_malformed_rows_are_none(row):
  assert chat_example(row, BYTE, "plain") is None


def test_chatml_with_hf_special_tokens(hf_path):
  tok = get_tokenizer(f"hf:{hf_path}")
  ids, labels = chat_example(ROW, tok, "chatml")
  start = tok.encode("<|im_start|>")
  assert len(start) == 1 and ids.tolist().count(start[0]) == 4 and ids.tolist().count(tok.eot_id) == 4
  scored = labels[labels != -100]
  assert (scored == ids[labels != -100]).all()
  assert scored.tolist().count(tok.eot_id) == 2  # after each assistant turn only
  assert tok.decode([i for i in scored.tolist() if i != tok.eot_id]) == "Yo éBye"


def _write_jsonl(path, rows):
  with open(path, "wb") as f:
    for row in rows:
      f.write(row if isinstance(row, bytes) else json.dumps(row).encode())
      f.write(b"\n")


@pytest.fixture
def chat_config(tmp_path):
  valid = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
           for i in range(5)]
  bad = [b"{not json", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {"text": "no messages"}]
  _write_jsonl(tmp_path / "chat_train.jsonl", valid + bad)
  _write_jsonl(tmp_path / "chat_validation.jsonl", [valid[0], bad[0], valid[1], bad[1], bad[2], valid[2]])
  c = data_config()
  c.name = f"chat:{tmp_path}/chat_{{split}}.jsonl"
  c.layout, c.seq_len, c.batch_size, c.data_dir = "pad_truncate", 48, 2, str(tmp_path)
  return c, valid


def test_chat_pipeline_rows_and_malformed_count(chat_config):
  c, valid = chat_config
  batches = list(make_eval_batches(c))
  assert len(batches) == 2 and sum(int(b["n_malformed"]) for b in batches) == 3
  assert [int(b["n_malformed"]) for b in batches] == [1, 2]  # skipped before row 2, before row 3
  rows = np.concatenate([b["labels"] for b in batches])
  for row, example in zip(rows, valid[:3]):
    ids, labels = chat_example(example, BYTE, "plain")
    assert row[:len(labels)].tolist() == labels.tolist() and (row[len(labels):] == -100).all()
  assert (rows[3] == -100).all() and batches[1]["attention_mask"][1].sum() == 0  # padded row


def test_chat_pipeline_pack_and_chatml(chat_config):
  c, _ = chat_config
  c.layout, c.chat_format, c.seq_len = "pack", "chatml", 256
  batch = next(make_train_iterator(c))
  ids, labels = batch["input_ids"], batch["labels"]
  scored = ids[labels != -100]
  assert (labels[labels != -100] == scored).all()
  assert BYTE.eot_id in scored.tolist() and BYTE.eos_id in scored.tolist()  # EOS after an assistant ending
  assert "answer" in BYTE.decode(scored) and "q1" not in BYTE.decode(scored)


def test_single_chat_file_is_train_only(chat_config, tmp_path):
  c, _ = chat_config
  c.name = f"chat:{tmp_path}/chat_train.jsonl"
  with pytest.raises(DataError, match="{split}"):
    make_eval_batches(c)
  c.name = f"chat:{tmp_path}/missing.jsonl"
  with pytest.raises(DataError, match="missing.jsonl"):
    make_train_iterator(c)
