"""IFT chat rows -> (input_ids, labels) with loss only on assistant content (MoC-PT, docs/mocpt_semantics.md).

Formats:
  plain  — MoC-PT's actual training format (the fallback path of its `data.py`):
           "<|user|>\\n" + content, turns joined with "\\n", "<|assistant|>\\n" + content; role tags are plain
           text, no system prompt is added, no end-of-turn token.
  chatml — "<|im_start|>role\\ncontent" + end-of-turn id, turns joined with "\\n"; the end-of-turn id after
           assistant content is labelled too, so the model learns to stop (MoC-PT's model cannot).
A token is labelled iff its character span overlaps an assistant content span (MoC-PT's offset rule), so
role prefixes, user text and separators are -100. A row without any assistant turn is trained on entirely.
"""
from __future__ import annotations

import numpy as np

IGNORE = -100


def _valid_messages(row):
  messages = row.get("messages") if isinstance(row, dict) else None
  if not isinstance(messages, list) or not messages:
    return None
  for m in messages:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
      return None
  return messages


def _label_spans(ids, offsets, spans):
  """Labels = ids where the token's (start, end) overlaps any [a, b) in `spans`, else IGNORE."""
  ids = np.asarray(ids, dtype=np.int32)
  labels = np.full_like(ids, IGNORE)
  if len(ids) and spans:
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
      hit |= (off[:, 0] < b) & (off[:, 1] > a) & (off[:, 1] > off[:, 0])
    labels[hit] = ids[hit]
  return ids, labels


def _render_plain(messages, tokenizer):
  text, spans = "", []
  for i, m in enumerate(messages):
    prefix = ("\n" if i else "") + f"<|{m['role']}|>\n"
    start = len(text) + len(prefix)
    text += prefix + m["content"]
    if m["role"] == "assistant":
      spans.append((start, start + len(m["content"])))
  return _label_spans(*tokenizer.encode_with_offsets(text), spans)


def _render_chatml(messages, tokenizer):
  ids, labels = [], []
  for i, m in enumerate(messages):
    prefix = ("\n" if i else "") + f"<|im_start|>{m['role']}\n"
    is_assistant = m["role"] == "assistant"
    spans = [(len(prefix), len(prefix) + len(m["content"]))] if is_assistant else []
    chunk_ids, chunk_labels = _label_spans(*tokenizer.encode_with_offsets(prefix + m["content"]), spans)
    ids.append(chunk_ids)
    labels.append(chunk_labels)
    ids.append(np.array([tokenizer.eot_id], np.int32))
    labels.append(np.array([tokenizer.eot_id if is_assistant else IGNORE], np.int32))
  return np.concatenate(ids), np.concatenate(labels)


def chat_example(row, tokenizer, chat_format: str):
  """(input_ids, labels) int32 arrays for one chat row, or None if the row is malformed."""
  messages = _valid_messages(row)
  if messages is None:
    return None
  render = _render_plain if chat_format == "plain" else _render_chatml
  ids, labels = render(messages, tokenizer)
  if not len(ids):
    return None
  if not any(m["role"] == "assistant" for m in messages):
    labels = ids.copy()
  return ids, labels
