"""Evaluation: fact recall on moc_facts probes (the training loop's) and, for a saved run,
`python -m moc_jax.eval --workdir=DIR`: CE on a split, recall by entity frequency, MCQ benchmarks and
routing analysis (run.py; the command line in __main__.py).
"""
from __future__ import annotations

from moc_jax.eval.probes import DOC_BUCKET_EDGES, HEAD_DOCS, ProbeEvaluator, recall_by_bucket, select_probes
from moc_jax.eval.run import EvalOptions, evaluate, markdown_table

__all__ = ["DOC_BUCKET_EDGES", "EvalOptions", "HEAD_DOCS", "ProbeEvaluator", "evaluate",
           "markdown_table", "recall_by_bucket", "select_probes"]
