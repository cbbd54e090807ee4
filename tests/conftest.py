"""Shared tiny models: built once per session, forward compiled once per (model, input shape).

Model-level tests pass every input (ids, key mask, parameters) as a jit argument, so changing the
parameters or the padding reuses the same compiled program.

The suite runs on the CPU (fake devices stand in for meshes): JAX_PLATFORMS=cpu unless set, for this process and
the commands it starts, so that an installed libtpu (the `tpu` extra) is loaded only by the tests that compile for
a TPU topology, not by every process at its first use of a backend.
"""
import io
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


# One persistent compilation cache per suite run, made by the first process that loads this file (the controller,
# before it starts its workers) and inherited by the workers and the commands they start. Many tests compile the same
# program (tiny's train step; the runs that are stopped and resumed by the same command): with the cache each is
# compiled once per run. It starts empty, so a run's time is a fresh machine's, and its maker removes it at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moc_jax-test-xla-cache-")

# The suite's CPU time is mostly compilation: LLVM at -O0 without its expensive passes cuts it by a sixth (make test
# 23.7 -> 19.9 CPU-min). It changes the machine code, not the program XLA optimises (its HLO passes, fusion, buffer
# assignment); the code may sum in another order, and every test's tolerance holds but where two programs of the
# same sums are compared to one order's rounding (the masked lazy AdamW step against the dense one): those are marked
# `default_backend` and run in a child pytest with LLVM as users have it (`pytest_pyfunc_call` below). Set once, for
# the workers and the commands they start.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_DEFAULT_BACKEND = "MOC_JAX_TEST_DEFAULT_BACKEND"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and not os.environ.get(_DEFAULT_BACKEND):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()

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


@pytest.fixture(scope="session")
def moc_tiny_mocpt_routing():
  """`tiny` routed as MoC-PT routes (`sequence` + `mocpt`, not tiny's default): for tests of that routing."""
  return Compiled("configs/moc.py:tiny", {"memory.routing": "sequence", "memory.load_balance": "mocpt"}, seed=1)


# Tokenizers trained offline on a tiny corpus (data tests use them; nothing is downloaded).
TOKENIZER_CORPUS = [f"Héllo world, this is tiny corpus número {i} about cats, dogs and <|im_end|> tokens." for i in range(200)]


@pytest.fixture(scope="session")
def hf_path(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


@pytest.fixture(scope="session")
def sp_path(tmp_path_factory):
  import sentencepiece
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(TOKENIZER_CORPUS), model_writer=model, vocab_size=60, user_defined_symbols=["<|im_end|>"],
      unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
  path = tmp_path_factory.mktemp("sp") / "tiny.model"
  path.write_bytes(model.getvalue())
  return str(path)



def pytest_sessionfinish(session):
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_pyfunc_call(pyfuncitem):
  """A `default_backend` test under the suite's -O0 flags runs again, alone, in a child pytest without them."""
  flags = os.environ.get("XLA_FLAGS", "")
  if pyfuncitem.get_closest_marker("default_backend") is None or _FAST_COMPILE not in flags:
    return None
  env = {**os.environ, "XLA_FLAGS": flags.replace(_FAST_COMPILE, "").strip(), _DEFAULT_BACKEND: "1"}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "",
                         pyfuncitem.nodeid], cwd=root, env=env, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  return True
