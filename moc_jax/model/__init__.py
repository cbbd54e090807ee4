"""The MoC transformer (Flax NNX)."""
from moc_jax.model.transformer import Transformer

__all__ = ["Transformer"]
