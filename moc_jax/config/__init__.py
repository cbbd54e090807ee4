"""The config: its schema (every field and default), loading (files, overrides, saved runs), validation,
and the facts derived from it (the layer plan). Nothing here imports the model, so every layer above can."""
from moc_jax.config.load import config_module, load_config, load_run_config, resolve_path, sibling
from moc_jax.config.plan import (BankShape, LayerPlan, bank_ids, bank_shape, base_tables, chapters_read,
                                 cluster_ranges, layer_plan, memory_layers, reads_chapters, reads_cluster_paths,
                                 router_factors, routing_is_causal, routing_statement, subtree_chapters)
from moc_jax.config.schema import base_config, data_config, parse_arg, runlocal
from moc_jax.config.validate import validate, validate_data, validate_upscale

__all__ = ["BankShape", "LayerPlan", "bank_ids", "bank_shape", "base_config", "base_tables", "chapters_read",
           "cluster_ranges", "config_module", "data_config", "layer_plan", "load_config", "load_run_config",
           "memory_layers", "parse_arg", "reads_chapters", "reads_cluster_paths", "router_factors", "resolve_path",
           "routing_is_causal", "routing_statement", "runlocal", "sibling", "subtree_chapters", "validate",
           "validate_data", "validate_upscale"]
