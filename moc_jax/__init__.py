"""moc_jax: Mixture-of-Chapters transformers in JAX/Flax NNX.

The public API (README.md): load a validated config, build the model, count its parameters.
"""
from moc_jax.config import load_config, validate
from moc_jax.errors import CheckpointError, ConfigError, DataError, MocJaxError, TrainingError
from moc_jax.model.build import abstract_model, build_model, count_params, param_groups

__all__ = ["CheckpointError", "ConfigError", "DataError", "MocJaxError", "TrainingError", "abstract_model",
           "build_model", "count_params", "load_config", "param_groups", "validate"]
