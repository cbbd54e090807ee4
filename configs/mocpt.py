"""MoC-PT YAML files as configs: `--config=configs/mocpt.py:PATH.yaml`.

PATH (relative to the working directory, or a `configs/...` path among the packaged configs) is a config of
the authors' PyTorch code, with their `model:`, `memory:` and `training:` sections and field names
(moc_jax.convert.mocpt_config.py maps them). Datasets and tokenizers are Hugging Face names there, so
`data.name` / `data.tokenizer` keep our defaults: override them.
Examples: configs/mocpt_examples/base_small_run2.yaml (the paper model), base_small.yaml.
`PATH,import` (what `python -m moc_jax.convert.mocpt` reads a checkpoint's config.yaml with): a run
length given as `training.num_epochs` is kept as `max_steps` with a warning instead of refused, since
an imported checkpoint is evaluated, not trained to that length; and a file without `training.max_length`
evaluates at min(model max_seq_len, 2048), with a warning, not at MoC-PT's training default 8192 (which pads
every evaluation row to 8192 tokens).
"""
from moc_jax.convert.mocpt_config import config_from_yaml


def get_config(arg="configs/mocpt_examples/base_small_run2.yaml"):
  for_import = arg.endswith(",import")
  return config_from_yaml(arg[:-len(",import")] if for_import else arg, for_import)
