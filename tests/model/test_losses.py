"""The chunked training loss equals the whole-sequence one (value and every gradient)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.losses import IGNORE, lm_loss


# moc (slow): the chunking is the loss's, whatever the model; vanilla checks it by default
@pytest.mark.parametrize("spec", [pytest.param("configs/moc.py:tiny", marks=pytest.mark.slow), "configs/vanilla.py:tiny"])
def test_chunked_loss_matches_whole_sequence_loss(spec):
  seed = 618033988  # fixed: a failure reproduces
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 260, (3, 32)).astype(np.int32)
  labels = np.where(rng.random((3, 32)) < 0.25, IGNORE, ids).astype(np.int32)
  mask = np.ones_like(ids)
  mask[0, -6:] = 0
  batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
  out = {}
  for chunk in (0, 8):
    config = moc_jax.load_config(spec, {"model.compute_dtype": "float32", "model.logits_chunk": chunk,
                                        "data.seq_len": 32, "model.max_seq_len": 32})
    graphdef, params, rest = nnx.split(moc_jax.build_model(config, seed % 1000), nnx.Param, ...)
    loss = lambda p: lm_loss(nnx.merge(graphdef, p, rest), batch, train=True)[0]
    out[chunk] = jax.jit(jax.value_and_grad(loss))(params)
  (l0, g0), (l8, g8) = out[0], out[8]
  np.testing.assert_allclose(float(l8), float(l0), rtol=1e-6, err_msg=f"seed {seed}")
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g8)):
    scale = float(jnp.max(jnp.abs(a))) + 1e-30
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, f"seed {seed}"
