"""Routing on packed rows: `segment` routing gives each document its own decision, and segment, prefix, chunk
and token routing never carry routing state across a document boundary (float64 numpy loops, and whole-model
checks against one document per row)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax.model.routing import document_bounds, document_cumsum, routing_input

TINY = "configs/moc.py:tiny"
SEGMENTS = np.array([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 2,   # three documents, then padding
                     [4] * 19,                              # one document
                     [1, 2] + [3] * 17])                    # one-token documents first


def _numpy_routing_input(h, valid, segments, routing, chunk):
  """Float64 loop over positions: the masked mean of the positions of its own document it may see."""
  b, length, _ = h.shape
  out = np.zeros(h.shape, np.float64)
  for r in range(b):
    for t in range(length):
      same, run = np.zeros(length, bool), [t]
      while run[0] > 0 and segments[r, run[0] - 1] == segments[r, t]:
        run.insert(0, run[0] - 1)
      while run[-1] < length - 1 and segments[r, run[-1] + 1] == segments[r, t]:
        run.append(run[-1] + 1)
      same[run] = True
      seen = same & {"segment": np.ones(length, bool), "prefix": np.arange(length) <= t,
                     "chunk": np.arange(length) < t // chunk * chunk}[routing] & valid[r]
      out[r, t] = h[r, seen].astype(np.float64).sum(0) / max(seen.sum(), 1)
  return out


@pytest.mark.parametrize("routing, chunk", [("segment", 1), ("prefix", 1), ("chunk", 4), ("chunk", 7)])
def test_routing_input_of_packed_rows_sees_only_its_document(routing, chunk):
  rng = np.random.default_rng(0)
  h = rng.normal(size=(3, 19, 6)).astype(np.float32)
  valid = SEGMENTS > 0
  ours = np.asarray(routing_input(jnp.asarray(h), jnp.asarray(valid), routing, chunk, jnp.asarray(SEGMENTS)))
  np.testing.assert_allclose(ours, _numpy_routing_input(h, valid, SEGMENTS, routing, chunk), rtol=1e-5, atol=1e-6)


def test_document_bounds_and_cumsum_restart_at_every_document():
  first, last = (np.asarray(x) for x in document_bounds(jnp.asarray(SEGMENTS)))
  np.testing.assert_array_equal(first[0], [0] * 5 + [5] * 9 + [14] * 3 + [17] * 2)
  np.testing.assert_array_equal(last[0], [4] * 5 + [13] * 9 + [16] * 3 + [18] * 2)
  np.testing.assert_array_equal(first[2, :3], [0, 1, 2])
  x = np.arange(1, 20, dtype=np.float32)[None].repeat(3, 0)
  sums = np.asarray(document_cumsum(jnp.asarray(x), jnp.asarray(SEGMENTS)))
  np.testing.assert_array_equal(sums[0, 5:8], [6, 13, 21])  # document 2 starts at 6 = x[5]
  np.testing.assert_array_equal(sums[1], np.cumsum(x[1]))


def test_segment_routing_without_segment_ids_is_the_rows_masked_mean():
  rng = np.random.default_rng(1)
  h = rng.normal(size=(2, 9, 4)).astype(np.float32)
  valid = np.ones((2, 9), bool)
  valid[0, 6:] = False
  ours = np.asarray(routing_input(jnp.asarray(h), jnp.asarray(valid), "segment", 1))
  ref = (h * valid[..., None]).sum(1) / valid.sum(1)[:, None]
  np.testing.assert_allclose(ours, np.broadcast_to(ref[:, None], h.shape), rtol=1e-6)


def _model(routing):
  cfg = moc_jax.load_config(TINY, {"model.compute_dtype": "float32", "memory.routing": routing,
                                   "memory.routing_chunk": 8, "memory.wo_init_zero": False})  # memory reads count
  return moc_jax.build_model(cfg, seed=0)


def _packed(docs, length):
  """One packed row of `docs` (token lists) padded to `length`: ids, mask, segment ids, positions."""
  ids, seg, pos = [], [], []
  for i, d in enumerate(docs):
    ids += d
    seg += [i + 1] * len(d)
    pos += list(range(len(d)))
  pad = length - len(ids)
  as_row = lambda x, fill: jnp.asarray([x + [fill] * pad])  # noqa: E731
  return as_row(ids, 0), as_row([1] * len(ids), 0), as_row(seg, 0), as_row(pos, 0)


@jax.jit
def _forward(graphdef, params, ids, mask, seg, pos):
  return nnx.merge(graphdef, params)(ids, mask, segment_ids=seg, positions=pos)[0]


def _logits(model, ids, mask, seg, pos):
  return np.asarray(_forward(*nnx.split(model), ids, mask, seg, pos))


@pytest.mark.parametrize("routing", ["segment", "prefix", "chunk", "token"])
def test_no_routing_state_crosses_a_document_boundary(routing):
  """Changing the first document of a packed row leaves the second document's logits bit-identical; under
  `sequence` routing (one decision per row, MoC-PT's) they change."""
  rng = np.random.default_rng(2)
  doc_a, doc_a2, doc_b = (rng.integers(3, 250, n).tolist() for n in (21, 21, 30))
  outs = {}
  for mode in (routing, "sequence"):
    model = _model(mode)
    outs[mode] = [_logits(model, *_packed([a, doc_b], 64))[0, 21:51] for a in (doc_a, doc_a2)]
  np.testing.assert_array_equal(outs[routing][0], outs[routing][1])
  assert np.abs(outs["sequence"][0] - outs["sequence"][1]).max() > 1e-3


@pytest.mark.parametrize("routing", ["segment", *(pytest.param(r, marks=pytest.mark.slow) for r in ("prefix", "token"))])
def test_a_packed_document_reads_as_if_it_had_its_own_row(routing):
  """segment: each document of a packed row routes as that document alone in a row (MoC-PT's one-document
  rows, without their padding); prefix and token likewise (chunk boundaries are the row's, so chunk differs)."""
  rng = np.random.default_rng(3)
  docs = [rng.integers(3, 250, n).tolist() for n in (13, 24, 9)]
  model = _model(routing)
  packed = _logits(model, *_packed(docs, 50))[0]
  start = 0
  for d in docs:
    alone = _logits(model, *_packed([d], len(d)))[0]
    np.testing.assert_allclose(packed[start:start + len(d)], alone, rtol=2e-5, atol=2e-5)
    start += len(d)
