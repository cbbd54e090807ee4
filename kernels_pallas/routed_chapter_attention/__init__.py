"""Attention from each token to its own routed chapters (`contract` states what every implementation does).

Each module imports only modules listed before it, so the package has no import cycle and each layer
can be understood without the ones above it:
  contract     the shapes, dtypes and results all implementations share, and their argument checks
  reference    the gathered oracle the tests compare against
  dispatch     the chapter-sorted tile plan, row reorders, per-token merge and per-block math
  xla          the plain-XLA fallback, on the same plan
  pallas_tpu   Mosaic TPU kernels
  pallas_gpu   Triton-style GPU kernels
  pallas       the kernels' entry point: checks, kernel selection, merge and custom VJP
  roofline     analytic FLOPs, bytes and roofline times of each implementation (also a CLI)
  api          the registry of implementations and the public `routed_chapter_attention`
"""
from kernels_pallas.routed_chapter_attention.api import routed_chapter_attention

__all__ = ["routed_chapter_attention"]
