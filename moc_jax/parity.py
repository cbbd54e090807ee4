"""`python -m moc_jax.parity FIXTURE.npz`: prove parity with MoC-PT on a fixture it produced.

Builds the equivalent float32 moc_jax model from the fixture's MoC-PT config, imports its weights, and
prints the relative error ||ours - theirs|| / ||theirs|| of the logits, the eval loss, the train loss
(CE + router aux) and every gradient. Exits 0 only if all are <= 1e-5.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import moc_jax
from moc_jax.convert.mocpt import load_mocpt_state, to_mocpt
from moc_jax.convert.mocpt_config import config_from_mocpt
from moc_jax.errors import DataError
from moc_jax.losses import lm_loss

TOLERANCE = 1e-5


def rel_err(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  denom = np.linalg.norm(theirs)
  return float(np.linalg.norm(ours - theirs) / (denom if denom > 0 else 1.0))


def compare(fixture_path: str) -> dict[str, float]:
  """{quantity: relative error} for one fixture (gradients keyed `grad/<MoC-PT name>`)."""
  fx = np.load(fixture_path)
  meta = json.loads(str(fx["meta_json"]))
  config = config_from_mocpt(meta["model"], meta["memory"], compute_dtype="float32")
  model = moc_jax.build_model(config)
  load_mocpt_state(model, {k[len("param/"):]: fx[k] for k in fx.files if k.startswith("param/")})
  batch = {k: jnp.asarray(fx[k]) for k in ("input_ids", "attention_mask", "labels")}

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, train):
    return lm_loss(nnx.merge(graphdef, params, rest), batch, train=train)

  logits, _ = model(batch["input_ids"], batch["attention_mask"], train=False)
  eval_loss, _ = jax.jit(loss_fn, static_argnums=1)(params, False)
  (train_loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)(params, True)
  errors = {"logits": rel_err(logits, fx["logits"]), "eval_loss": rel_err(eval_loss, fx["eval_loss"]),
            "train_loss": rel_err(train_loss, fx["train_loss"])}
  ours = to_mocpt(config, grads.to_pure_dict())
  theirs = {k[len("grad/"):]: fx[k] for k in fx.files if k.startswith("grad/")}
  missing = sorted(set(theirs) ^ set(ours))
  if missing:
    raise SystemExit(f"gradient keys differ between fixture and model: {missing[:5]}")
  errors.update({f"grad/{k}": rel_err(ours[k], theirs[k]) for k in sorted(theirs)})
  return errors


def main(argv):
  if len(argv) != 2:
    print("usage: python -m moc_jax.parity FIXTURE.npz", file=sys.stderr)
    return 2
  if not os.path.isfile(argv[1]):
    raise DataError(f"parity fixture {argv[1]!r} not found; pass a .npz written by "
                    "tests/fixtures/make_mocpt_fixture.py, e.g. tests/fixtures/moc_pt_paper_small.npz")
  errors = compare(argv[1])
  width = max(map(len, errors))
  for name, err in errors.items():
    print(f"{name:<{width}}  {err:.3e}  {'ok' if err <= TOLERANCE else 'FAIL'}")
  worst = max(errors, key=errors.get)
  ok = errors[worst] <= TOLERANCE
  print(f"{'PASS' if ok else 'FAIL'}: {len(errors)} quantities, worst {worst} = {errors[worst]:.3e} "
        f"(tolerance {TOLERANCE:.0e})")
  return 0 if ok else 1


if __name__ == "__main__":
  from moc_jax import cli
  cli.run(main)
