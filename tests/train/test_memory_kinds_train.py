"""The product-key value table (memory.kind pkm, hml) in the real jitted train step: it is the 'bank' group, and
`train.bank_optimizer=lazy_adam` trains it through the chapter bank's mechanism (its rows read through zero
deltas, `SparseRows`, `LazyBankOptimizer`).

* From one initial state, lazy AdamW and dense AdamW take the same first update on every row read (one AdamW
  step each) and on every other parameter; the rows no lookup named keep their values and moments bit for bit
  under lazy AdamW (dense AdamW decays them).
* Over three updates a row's count is the number of updates whose lookups named it, every row a lookup named
  moved, and the table's gradient is zero outside the rows named.
* The parameter groups: the table is 'bank'; sub-keys, queries, gates and the hml block are 'memory'.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import sharding
from moc_jax import state as state_lib
from moc_jax.config import bank_ids
from moc_jax.losses import lm_loss
from moc_jax.model.build import param_groups
from moc_jax.train import step as step_lib
from tests.train import train_utils as tu

BASE = {"model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2, "train.grad_accum": 2,
        "train.warmup_steps": 0, "train.schedule": "constant", "memory.sharing": "per_layer",
        "memory.pkm_sub_keys": 16, "memory.pkm_top_k": 4, "memory.pkm_key_dim": 16, "memory.wo_init_zero": False,
        "model.compute_dtype": "float32"}
STEPS = 3



def named_rows(graphdef, config, params, rows):
  """(rows with a nonzero table gradient, rows some lookup named), bool [tables, N], on one micro-batch."""
  def loss(p):
    value, (_, aux) = lm_loss(nnx.merge(graphdef, p), rows, train=True)
    return value, aux["slots"]
  grads, slots = jax.grad(loss, has_aux=True)(params)
  g = grads["bank"]["memory"][...]
  tables = jnp.asarray(bank_ids(config)).reshape((-1,) + (1,) * (slots.ndim - 1))
  named = jnp.zeros(g.shape[:2], bool).at[jnp.broadcast_to(tables, slots.shape), slots].set(True)
  return jnp.any(g != 0, axis=-1), named


def train(kind, optimizer, steps):
  """{"config", "init" params, "states" after each update, "named" rows per update [steps, tables, N], and on a
  fresh micro-batch after training "support" (rows with a nonzero table gradient) and "last" (rows named)}."""
  config = moc_jax.load_config("configs/moc.py:tiny", {**BASE, "memory.kind": kind,
                                                      "train.bank_optimizer": optimizer})
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  with sharding.activate(mesh, sharding.rules_of(config)):
    layout = state_lib.build_state(config, mesh)
    state = layout.init()
    if kind == "hml":  # hml's table starts at zero: drawn values, so its reads carry gradients to the keys
      t = state["params"]["bank"]["memory"]
      state["params"]["bank"]["memory"] = t.replace(jax.random.normal(jax.random.key(3), t.shape))
    out = {"config": config, "init": jax.tree.map(np.asarray, state["params"]), "states": [], "named": []}
    data_sharding = sharding.data_sharding(config, mesh)
    step = step_lib.jit_train_step(layout.graphdef, layout.tx, config, layout.shardings, data_sharding)
    look = jax.jit(functools.partial(named_rows, layout.graphdef, config))
    bs = config.train.batch_size
    for s in range(steps):
      rows = tu.random_batch(config, s)
      micro = [jax.tree.map(lambda x: x[i * bs:(i + 1) * bs], rows) for i in range(config.train.grad_accum)]
      out["named"].append(np.any([np.asarray(look(state["params"], mb)[1]) for mb in micro], axis=0))
      state, _ = step(state, jax.device_put(rows, data_sharding))
      out["states"].append(jax.tree.map(np.asarray, state))
    support, last = look(state["params"], jax.tree.map(lambda x: x[:bs], tu.random_batch(config, 99)))
  return {**out, "named": np.stack(out["named"]), "support": np.asarray(support), "last": np.asarray(last)}


@pytest.fixture(scope="module", params=["pkm", pytest.param("hml", marks=pytest.mark.slow)])  # ~20 s a kind
def runs(request):
  return {"lazy": train(request.param, "lazy_adam", STEPS), "dense": train(request.param, "dense", 1)}


def table(params):
  return np.asarray(params["bank"]["memory"][...])


def test_lazy_adam_takes_dense_adamws_first_update_on_the_rows_read(runs):
  lazy, dense = runs["lazy"]["states"][0], runs["dense"]["states"][0]
  read = runs["lazy"]["named"][0]
  assert read.any() and (~read).any()
  t0, t_lazy, t_dense = table(runs["lazy"]["init"]), table(lazy["params"]), table(dense["params"])
  np.testing.assert_allclose(t_lazy[read], t_dense[read], rtol=1e-6, atol=1e-7)
  assert t_lazy[~read].tobytes() == t0[~read].tobytes()        # lazy: untouched
  assert np.all(t_dense[~read] != t0[~read])                     # dense: weight decay moves every row
  rest = lambda p: jax.tree.leaves(p.filter(lambda path, _: "bank" not in map(str, path)))  # noqa: E731
  for a, b in zip(rest(lazy["params"]), rest(dense["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  mu = np.asarray(jax.tree.leaves(lazy["opt_state"].bank.mu)[0])
  assert not mu[~read].any() and mu[read].any()


def test_counts_follow_the_rows_each_update_named(runs):
  run = runs["lazy"]
  final = run["states"][-1]
  counts = np.asarray(jax.tree.leaves(final["opt_state"].bank.count)[0])
  np.testing.assert_array_equal(counts, run["named"].sum(axis=0))
  moved = np.any(table(final["params"]) != table(run["init"]), axis=-1)
  np.testing.assert_array_equal(moved, run["named"].any(axis=0))
  assert run["support"].any() and not np.any(run["support"] & ~run["last"])  # the gradient lives on rows named


def test_parameter_groups_of_the_kinds():
  for kind in ("pkm", "hml"):
    config = moc_jax.load_config("configs/moc.py:tiny", {**BASE, "memory.kind": kind})
    groups = {"/".join(map(str, path)): param_groups(path)
              for path, _ in nnx.to_flat_state(nnx.state(moc_jax.abstract_model(config), nnx.Param))}
    assert groups["bank/memory"] == "bank"
    memory = {p: g for p, g in groups.items() if "/memory/" in f"/{p}/" and p != "bank/memory"}
    assert memory and set(memory.values()) == {"memory"}, memory
    assert any("keys" in p for p in memory)
    assert {g for p, g in groups.items() if p not in memory and p != "bank/memory"} == {"base"}
