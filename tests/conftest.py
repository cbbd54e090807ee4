"""Shared tiny models: built once per session, forward compiled once per (model, input shape).

Model-level tests pass every input (ids, key mask, parameters) as a jit argument, so changing the
parameters or the padding reuses the same compiled program.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import moc_jax

F32 = {"model.compute_dtype": "float32"}


class Compiled:
  """A built model with a jitted `(ids, mask=None, state=None) -> (logits, aux)`."""

  def __init__(self, spec, overrides=None, seed=0):
    self.cfg = moc_jax.load_config(spec, {**F32, **(overrides or {})})
    self.model = moc_jax.build_model(self.cfg, seed=seed)
    self.graphdef, self.state = nnx.split(self.model)
    graphdef = self.graphdef
    self._fwd = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))

  def __call__(self, ids, mask=None, state=None):
    ids = jnp.asarray(ids, jnp.int32)
    mask = jnp.ones(ids.shape, jnp.int32) if mask is None else jnp.asarray(mask, jnp.int32)
    return self._fwd(self.state if state is None else state, ids, mask)


@pytest.fixture(scope="session")
def vanilla_tiny():
  return Compiled("configs/vanilla.py:tiny", seed=1)


@pytest.fixture(scope="session")
def moc_tiny():
  return Compiled("configs/moc.py:tiny", seed=1)
