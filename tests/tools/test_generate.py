"""Cached decoding and generation: cached logits equal an independent full forward in every decode
routing mode, sampling, and the `python -m moc_jax.generate` command line."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import generate
from moc_jax.errors import CheckpointError, ConfigError, UsageError
from moc_jax.model import decode, memory
from tests.train import train_utils as tu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = "configs/moc.py:tiny"
# per-position reads through the reference kernel, which compiles fastest (the kernels agree: tests/kernels/)
SMALL = {"model.compute_dtype": "float32", "model.max_seq_len": 32, "data.seq_len": 32,
         "memory.routing_chunk": 4, "memory.routing_window": 4, "memory.attention_impl": "reference"}
B, L, P = 2, 16, 6  # rows, tokens, prompt length (chunk boundaries inside the prompt, at its end, while decoding)
PAD = 2             # row 1 is left-padded by this many slots
W = SMALL["memory.routing_window"]


def _cfg(**overrides):
  return moc_jax.load_config(TINY, {**SMALL, **overrides})


@pytest.fixture(scope="module")
def params(moc_tiny):
  """The shared tiny model's parameters (4 layers, memory at 1 and 3, scanned) with the zero-initialised
  ones (memory W_o, router bias) re-drawn, so the memory read reaches the logits."""
  leaves, treedef = jax.tree.flatten(nnx.state(moc_tiny.model, nnx.Param))
  keys = jax.random.split(jax.random.key(6), len(leaves))
  return jax.tree.unflatten(treedef, [x if np.any(np.asarray(x)) else 0.02 * jax.random.normal(k, x.shape)
                                      for k, x in zip(keys, leaves)])


@pytest.fixture(scope="module")
def batch():
  ids = np.random.default_rng(7).integers(0, 256, (B, L)).astype(np.int32)
  valid = np.ones((B, L), bool)
  valid[1, :PAD] = False
  ids[1, :PAD] = 0
  return jnp.asarray(ids), jnp.asarray(valid)


def _forward(graphdef):
  def full(params, ids, valid):
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return nnx.merge(graphdef, params)(ids, valid, positions=positions)[0]
  return full


@functools.cache
def _model(routing="sequence", decode_routing="auto", impl="reference", pool="mean"):
  """(graphdef, jitted full forward, jitted teacher-forced cached decoding) for one routing set-up."""
  config = _cfg(**{"memory.routing": routing, "memory.decode_routing": decode_routing, "memory.attention_impl": impl,
                   "memory.routing_pool": pool})
  graphdef = nnx.split(moc_jax.abstract_model(config), nnx.Param)[0]

  @functools.partial(jax.jit, static_argnums=3)
  def cached(params, ids, valid, prompt_len):
    """The prompt in one step, then one token per step."""
    model = nnx.merge(graphdef, params)
    cache, first = decode.step(model, decode.init_cache(model, ids.shape[0], ids.shape[1]),
                               ids[:, :prompt_len], valid[:, :prompt_len])

    def one(cache, x):
      cache, logits = decode.step(model, cache, x[0][:, None], x[1][:, None])
      return cache, logits[:, 0]

    _, rest = jax.lax.scan(one, cache, (ids[:, prompt_len:].T, valid[:, prompt_len:].T))
    return jnp.concatenate([first, rest.transpose(1, 0, 2)], axis=1)

  return graphdef, jax.jit(_forward(graphdef)), cached


def _close(got, want, valid, what):
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(got)[v], np.asarray(want)[v], rtol=1e-5, atol=1e-5, err_msg=what)


def _differ(a, b, valid):
  return np.max(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(valid)]) > 1e-4


@pytest.mark.parametrize("routing, impl", [("token", "reference"), ("prefix", "reference"), ("chunk", "reference"),
                                           pytest.param("token", "xla", marks=pytest.mark.slow),
                                           pytest.param("chunk", "xla", marks=pytest.mark.slow)])
def test_cached_decoding_of_a_causal_mode_gives_the_full_forward_logits(routing, impl, params, batch):
  _, full, cached = _model(routing, impl=impl)
  ids, valid = batch
  want = full(params, ids, valid)
  _close(cached(params, ids, valid, P), want, valid, routing)
  assert _differ(_model("token" if routing == "prefix" else "prefix")[1](params, ids, valid), want, valid)


@pytest.fixture(scope="module")
def pooled_params(params):
  """`params` plus a learned pooling query (memory layers 1 and 3) whose scores of a few units weigh the
  positions far from equally."""
  state = nnx.state(moc_jax.abstract_model(_cfg(**{"memory.routing_pool": "attention"})), nnx.Param)
  have = {tuple(map(str, p)): v[...] for p, v in nnx.to_flat_state(params)}
  query = 0.3 * jax.random.normal(jax.random.key(8), (2, 64))
  return jax.tree.unflatten(jax.tree.structure(state), [query if "pool_query" in map(str, p) else have[tuple(map(str, p))]
                                                        for p, _ in nnx.to_flat_state(state)])


@pytest.mark.parametrize("routing", ["prefix", "chunk"])
def test_cached_decoding_keeps_the_attention_pooled_weights(routing, params, pooled_params, batch):
  """The cached running sums carry each input's pooling weight: cached logits equal the full forward's, which
  differ from the plain mean's."""
  _, full, cached = _model(routing, pool="attention")
  ids, valid = batch
  want = full(pooled_params, ids, valid)
  _close(cached(pooled_params, ids, valid, P), want, valid, routing)
  assert _differ(_model(routing)[1](params, ids, valid), want, valid)


def _pooled_over(first_slot, last_slot):
  """A `routing_input` for prefix-routed models in which position t pools the non-pad layer inputs at
  slots first_slot(t)..last_slot(t): a per-position reference for the decode-only strategies."""
  def routing_input(h, valid, routing, chunk, segments=None, weights=None):
    assert routing == "prefix" and segments is None
    t = jnp.arange(h.shape[1])
    seen = (t[None, :] >= first_slot(t)[:, None]) & (t[None, :] <= last_slot(t)[:, None])  # [position, slot]
    w = seen[None].astype(jnp.float32) * (valid if weights is None else weights).astype(jnp.float32)[:, None, :]
    return jnp.einsum("bts,bsd->btd", w, h.astype(jnp.float32)) / jnp.maximum(w.sum(-1), 1e-30)[..., None]
  return routing_input


REFERENCES = {  # decode routing -> the slots each position's decision pools (first, last)
    "sequence": (lambda t: 0 * t, lambda t: 0 * t + P - 1),
    "rolling": (lambda t: jnp.where(t < P, P - W, t - W + 1), lambda t: jnp.maximum(t, P - 1)),
    "hybrid": (lambda t: jnp.where(t < P, 0, t - W + 1), lambda t: jnp.maximum(t, P - 1)),
}


@pytest.mark.parametrize("decode_routing, pool", [("sequence", "mean"), ("sequence", "attention"),
                                                  pytest.param("rolling", "mean", marks=pytest.mark.slow),
                                                  pytest.param("rolling", "attention", marks=pytest.mark.slow),
                                                  pytest.param("hybrid", "mean", marks=pytest.mark.slow)])
def test_decode_only_strategies_equal_a_full_forward_reading_what_they_chose(decode_routing, pool, params,
                                                                           pooled_params, batch, monkeypatch):
  """`sequence`: every position reads the chapters routed on the prompt's mean; `rolling`: the prompt
  reads those of its last W inputs, each new token those of the W inputs up to it; `hybrid`: the
  prompt's mean, then as rolling. With attention pooling, the weighted means of the same inputs. Reference: a
  prefix-routed full forward (same mixing as sequence) whose positions pool exactly those inputs."""
  ids, valid = batch
  params = pooled_params if pool == "attention" else params
  got = _model("sequence", decode_routing, pool=pool)[2](params, ids, valid, P)
  monkeypatch.setattr(memory, "routing_input", _pooled_over(*REFERENCES[decode_routing]))
  want = jax.jit(_forward(_model("prefix", pool=pool)[0]))(params, ids, valid)  # traced here, with the patch
  _close(got, want, valid, decode_routing)


@pytest.fixture(scope="module")
def generator():
  return generate.Generator(_model("prefix")[0])


def _prompts(batch):
  ids, valid = (np.asarray(x) for x in batch)
  return [ids[i, :P][valid[i, :P]].tolist() for i in range(B)]


def test_greedy_generation_is_the_argmax_of_the_full_forward(generator, params, batch):
  out = generator(params, _prompts(batch), L - P)
  assert [len(o) for o in out] == [L - P] * B
  ids = np.asarray(batch[0]).copy()
  ids[:, P:] = out
  logits = np.asarray(_model("prefix")[1](params, jnp.asarray(ids), batch[1]))
  np.testing.assert_array_equal(logits[:, P - 1:-1].argmax(-1), ids[:, P:])


def _sampled(generator, params, batch, seed):
  return generator(params, _prompts(batch), L - P, temperature=1.0, top_p=0.9, seed=seed)


def test_sampling_is_reproducible_from_its_seed(generator, params, batch):
  first = _sampled(generator, params, batch, 0)
  assert _sampled(generator, params, batch, 0) == first and _sampled(generator, params, batch, 1) != first
  assert generator.decode._cache_size() == 1  # one compiled loop for every token and sampling setting


@pytest.mark.slow
def test_generation_stops_at_a_stop_token(generator, params, batch):
  first = _sampled(generator, params, batch, 0)
  stop = first[0][2]
  stopping = generate.Generator(_model("prefix")[0], stop_ids=(stop,))
  out = _sampled(stopping, params, batch, 0)
  assert out == [row[:row.index(stop)] if stop in row else row for row in first]


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))  # 4000 independent draws per call
  draws = lambda top_p: np.asarray(generate.sample(logits, jax.random.key(0), 1.0, top_p))  # noqa: E731
  assert set(draws(0.4)) == {0} and set(draws(0.75)) == {0, 1} and set(draws(0.85)) == {0, 1, 2}
  assert set(draws(1.0)) == {0, 1, 2, 3} and abs(np.mean(draws(1.0) == 0) - 0.5) < 0.03
  assert set(np.asarray(generate.sample(logits, jax.random.key(0), 0.0, 0.4))) == {0}


def _saved_run(tmp_path, **overrides):
  """A workdir holding only config.json (enough for the checks made before restoring)."""
  (tmp_path / "config.json").write_text(_cfg(**overrides).to_json_best_effort())
  return str(tmp_path)


def test_bad_inputs_name_the_fix(tmp_path):
  with pytest.raises(ConfigError, match="does not exist; pass the directory of a training run"):
    generate.run(str(tmp_path / "missing"), ["hi"], 4)
  workdir = _saved_run(tmp_path)
  with pytest.raises(UsageError, match=r"--routing=sideways: unknown; use one of \['auto', 'sequence'"):
    generate.run(workdir, ["hi"], 4, routing="sideways")
  with pytest.raises(UsageError, match="prompt is 40 tokens and model.max_seq_len is 32.*shorten the prompt"):
    generate.run(workdir, ["x" * 40], 4)
  with pytest.raises(ConfigError, match="memory.routing_window"):
    generate.run(workdir, ["hi"], 4, overrides={"memory.routing_window": 0})
  with pytest.raises(CheckpointError, match="no checkpoint of step 7"):
    generate.run(workdir, ["hi"], 4, step=7)


def _cli(args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "moc_jax.generate", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_generates_from_a_freshly_trained_run(tmp_path):
  proc = _cli(["--prompt", "hi"])
  assert proc.returncode == 2 and "--workdir=DIR is required" in proc.stderr, proc.stderr
  from moc_jax.main import train
  workdir = tmp_path / "run"
  train(moc_jax.load_config(TINY, tu.overrides(tmp_path / "data")), str(workdir))
  proc = _cli([f"--workdir={workdir}", "--prompt", "The city of", "--max_new_tokens=8"])
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("The city of") and len(proc.stdout) > len("The city of\n")
  summary = json.loads(proc.stderr.strip().splitlines()[-1])
  assert summary["step"] == 2 and summary["routing"] == "prefix" and 1 <= summary["new_tokens"][0] <= 8  # tiny: causal
  proc = _cli([f"--workdir={workdir}", "--prompt", "A", "--prompt", "The city of", "--max_new_tokens=4",
               "--temperature=0.8", "--top_p=0.9", "--seed=3", "--routing=hybrid", "--step=2",
               "--config.memory.routing_window=2"])
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stderr.strip().splitlines()[-1])["routing"] == "hybrid"
  proc = _cli([f"--workdir={workdir}", "--prompt", "A", "--routing=sideways"])
  assert proc.returncode == 2 and "use one of" in proc.stderr
