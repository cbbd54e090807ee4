"""Multiple-choice benchmarks from local .jsonl files, scored as lm-eval-harness scores them.

One JSON object a line, in the shape the benchmark's usual release has (the format is recognised from
the fields of the first line):

| format     | fields                                        | context                                | choices      |
|------------|-----------------------------------------------|----------------------------------------|--------------|
| arc        | question, choices{text,label}, answerKey      | "Question: q\\nAnswer:"                 | choices.text |
| openbookqa | question_stem, choices{text,label}, answerKey | question_stem                          | choices.text |
| boolq      | question, passage, answer (bool)              | "passage\\nQuestion: q?\\nAnswer:"       | no, yes      |
| mmlu       | question, choices, answer (index) [, subject] | question, "A. ..." lines, "Answer:"    | A, B, C, D   |
| hellaswag  | ctx (or ctx_a + ctx_b), endings, label        | "activity_label: ctx" (cleaned)        | endings      |

Each choice is scored by the summed log-likelihood of " " + choice after the context (`acc`: the
argmax is the answer) and by that sum over the choice's length in characters (`acc_norm`, lm-eval's
length normalisation). k-shot: the same K examples of the dev file (a fixed random draw), each as its
context + " " + its answer, precede every question, separated by blank lines.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from moc_jax.errors import DataError
from moc_jax.eval.scoring import continuation, make_rows, stderr

SHOT_SEED = 1234  # lm-eval-harness's default few-shot seed


@dataclasses.dataclass(frozen=True)
class Item:
  context: str
  choices: tuple[str, ...]
  gold: int
  preamble: str = ""  # precedes the few-shot examples (MMLU's subject line)


class _Bad(ValueError):
  """A record does not fit its format; the message names the field."""


def _field(record, key, kind, what):
  if key not in record:
    raise _Bad(f"missing field {key!r} ({what})")
  value = record[key]
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    raise _Bad(f"field {key!r} must be {what}, got {type(value).__name__} {value!r:.60}")
  return value


def _strings(value, key):
  if not value or not all(isinstance(v, str) for v in value):
    raise _Bad(f"field {key!r} must be a non-empty list of strings")
  return tuple(value)


def _lettered(record, stem_key):
  """ARC / OpenBookQA: choices {text, label} and the label of the answer."""
  choices = _field(record, "choices", dict, "an object {text: [...], label: [...]}")
  text = _strings(choices.get("text"), "choices.text")
  labels = [str(v) for v in _strings(choices.get("label"), "choices.label")]
  key = str(_field(record, "answerKey", (str, int), "the label of the answer")).strip()
  if len(labels) != len(text) or key not in labels:
    raise _Bad(f"field 'answerKey' {key!r} is not one of choices.label {labels}")
  return _field(record, stem_key, str, "the question text"), text, labels.index(key)


def _arc(record):
  question, text, gold = _lettered(record, "question")
  return Item(f"Question: {question}\nAnswer:", text, gold)


def _openbookqa(record):
  return Item(*_lettered(record, "question_stem"))


def _boolq(record):
  passage = _field(record, "passage", str, "the passage text")
  question = _field(record, "question", str, "the question text")
  return Item(f"{passage}\nQuestion: {question}?\nAnswer:", ("no", "yes"),
              int(_field(record, "answer", bool, "true or false")))


def _mmlu(record):
  question = _field(record, "question", str, "the question text")
  choices = _strings(_field(record, "choices", list, "a list of answer texts"), "choices")
  answer = _field(record, "answer", int, "the index of the answer in choices")
  if not 0 <= answer < len(choices) or len(choices) > 26:
    raise _Bad(f"field 'answer' {answer} is not an index into the {len(choices)} choices")
  letters = tuple(chr(ord("A") + i) for i in range(len(choices)))
  lines = "".join(f"\n{letter}. {c}" for letter, c in zip(letters, choices))
  subject = record.get("subject")
  preamble = (f"The following are multiple choice questions (with answers) about "
              f"{subject.replace('_', ' ')}.\n\n") if isinstance(subject, str) and subject else ""
  return Item(f"{question.strip()}{lines}\nAnswer:", letters, answer, preamble)


def _hellaswag_clean(text):
  text = text.strip().replace(" [title]", ". ")
  return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(record):
  if "ctx_a" in record:
    ctx = _field(record, "ctx_a", str, "text") + " " + _field(record, "ctx_b", str, "text").capitalize()
  else:
    ctx = _field(record, "ctx", str, "the context text")
  endings = _strings(_field(record, "endings", list, "a list of endings"), "endings")
  label = _field(record, "label", (int, str), "the index of the right ending")
  if not str(label).isdigit() or int(label) >= len(endings):
    raise _Bad(f"field 'label' {label!r} is not an index into the {len(endings)} endings")
  activity = record.get("activity_label")
  query = f"{activity}: {ctx}" if isinstance(activity, str) and activity else ctx
  return Item(_hellaswag_clean(query), tuple(_hellaswag_clean(e) for e in endings), int(label))


# format -> (does a record look like it, record -> Item, the fields, for messages)
FORMATS = {
    "openbookqa": (lambda r: "question_stem" in r, _openbookqa, "question_stem, choices{text,label}, answerKey"),
    "hellaswag": (lambda r: "endings" in r, _hellaswag, "ctx (or ctx_a, ctx_b), endings, label"),
    "boolq": (lambda r: "passage" in r, _boolq, "question, passage, answer (bool)"),
    "arc": (lambda r: isinstance(r.get("choices"), dict), _arc, "question, choices{text,label}, answerKey"),
    "mmlu": (lambda r: isinstance(r.get("choices"), list), _mmlu, "question, choices (list), answer (int)"),
}


def detect_format(record) -> str | None:
  return next((name for name, (looks, _, _) in FORMATS.items() if looks(record)), None)


def load(path: str) -> tuple[str, list[Item]]:
  """(format, items) of a .jsonl file; DataError naming the file, line and field on bad input."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except OSError as e:
    raise DataError(f"MCQ file {path!r} cannot be read ({e.strerror}); pass --mcq=name:path/to/file.jsonl") from e
  fmt, items = None, []
  for lineno, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); each line must hold one "
                      "JSON object") from e
    if not isinstance(record, dict):
      raise DataError(f"{path}:{lineno}: a line must hold a JSON object, not {type(record).__name__}")
    if fmt is None:
      fmt = detect_format(record)
      if fmt is None:
        known = "; ".join(f"{name}: {fields}" for name, (_, _, fields) in FORMATS.items())
        raise DataError(f"{path}:{lineno}: unknown multiple-choice format (fields {sorted(record)}); "
                        f"convert it to one of — {known}")
    try:
      items.append(FORMATS[fmt][1](record))
    except _Bad as e:
      raise DataError(f"{path}:{lineno}: {fmt} record: {e} (fields: {FORMATS[fmt][2]})") from e
  if not items:
    raise DataError(f"MCQ file {path!r} holds no records")
  return fmt, items


def with_shots(items, dev_items, shots: int, seed: int = SHOT_SEED) -> list[tuple[str, tuple[str, ...], int]]:
  """(context, choices, gold) per item, its context preceded by `shots` dev examples (one fixed draw)."""
  if shots and len(dev_items) < shots:
    raise DataError(f"--shots {shots} needs at least {shots} dev examples, the dev file has {len(dev_items)}")
  picks = np.random.default_rng(seed).choice(len(dev_items), shots, replace=False) if shots else []
  shown = [dev_items[i] for i in picks]
  prefix = "".join(f"{d.context}{continuation(d.context, d.choices[d.gold])}\n\n" for d in shown)
  return [(item.preamble + prefix + item.context, item.choices, item.gold) for item in items]


def evaluate(scorer, params, questions, tokenizer, max_len: int) -> dict:
  """acc / acc_norm (± standard error) of `questions` [(context, choices, gold)] under params."""
  pairs = [(tokenizer.encode(ctx), tokenizer.encode(continuation(ctx, choice)))
           for ctx, choices, _ in questions for choice in choices]
  rows = make_rows(pairs, tokenizer.pad_id, max_len)
  loglik, _ = scorer(params, rows)
  starts = np.cumsum([0] + [len(c) for _, c, _ in questions])
  acc, acc_norm = [], []
  for (ctx, choices, gold), s, e in zip(questions, starts, starts[1:]):
    ll = loglik[s:e].astype(np.float64)
    acc.append(int(np.argmax(ll)) == gold)
    acc_norm.append(int(np.argmax(ll / np.array([max(len(c), 1) for c in choices], np.float64))) == gold)
  n = len(questions)
  a, an = float(np.mean(acc)), float(np.mean(acc_norm))
  return {"items": n, "acc": a, "acc_stderr": stderr(a, n), "acc_norm": an, "acc_norm_stderr": stderr(an, n),
          "chance": float(np.mean([1.0 / len(c) for _, c, _ in questions])), "truncated_rows": rows.truncated}
