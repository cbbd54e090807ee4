"""Assertions shared across the test tree."""
import jax
import numpy as np


def assert_same_bytes(got, want):
  """Same tree structure, and every leaf of the same dtype, shape and bytes (-0.0 and NaN payloads included)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert (g.dtype, g.shape) == (w.dtype, w.shape)
    assert g.tobytes() == w.tobytes()
