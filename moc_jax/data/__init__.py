"""Input pipelines: tokenizers, the embedded `moc_facts` corpus, Grain train/eval iterators, IFT chat rows.

Public API (batch format in `pipeline.py`): `make_train_iterator`, `make_eval_batches`, `load_probes`,
`get_tokenizer`. The data config's fields and defaults live with every other field (config/schema.py).
"""
from moc_jax.data.pipeline import load_probes, make_eval_batches, make_train_iterator
from moc_jax.data.tokenizers import get_tokenizer

__all__ = ["get_tokenizer", "load_probes", "make_eval_batches", "make_train_iterator"]
