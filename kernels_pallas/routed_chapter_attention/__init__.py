"""Attention from each token to its own routed chapters (see api.py for the contract)."""
from kernels_pallas.routed_chapter_attention.api import routed_chapter_attention

__all__ = ["routed_chapter_attention"]
