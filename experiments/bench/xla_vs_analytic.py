"""P5: the estimator's forward FLOPs against XLA's own count of the compiled forward (compile only).

The forward is the training loss (logits, cross-entropy and router aux terms, which the estimator
counts too), lowered from ShapeDtypeStructs, so even the 262k model allocates nothing; XLA's
`cost_analysis()["flops"]` of the compiled program is compared with `flops.estimate(...)["forward"]`.
Layers are unrolled (model.scan_layers=False): XLA's cost analysis counts a while-loop body once, not
once per trip. The scanned program's count is reported too: compiled for an accelerator it undercounts; on a
CPU the model unrolls its layer scan (model/transformer.py), so there the two counts agree. Each component
(self-attention, MLP, memory sublayer, head) is also compiled and compared on its own, to locate the
difference. XLA counts a dot as exactly 2·M·N·K, like the estimator, so `xla_minus_analytic_matmul`
is XLA's element-wise count, to set against `analytic_elementwise`; XLA also counts every f32<->bf16
convert as a FLOP and reports exp/rsqrt/logistic apart, as `transcendentals`. Goal: whole forward
within 5%.

`python -m experiments.bench.xla_vs_analytic [--config=configs/moc.py:262k] [--batch_size 1] [--noscanned]`
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

import moc_jax
from experiments.bench import common
from moc_jax import cli, flops
from moc_jax.losses import lm_loss

GOAL = 0.05

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:262k", 1)
flags.DEFINE_bool("scanned", True, "also compile the scanned forward (--noscanned skips it)", flag_values=_FLAGS)


def xla_cost(fn, *abstract_args) -> dict:
  """XLA's cost analysis of `fn` compiled for these ShapeDtypeStructs (never run)."""
  cost = jax.jit(fn).lower(*abstract_args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"flops": float(cost.get("flops", 0.0)), "transcendentals": float(cost.get("transcendentals", 0.0))}


def forward_cost(config, scan_layers: bool) -> dict:
  c = config.copy_and_resolve_references()
  c.model.scan_layers = scan_layers
  graphdef, params = nnx.split(moc_jax.abstract_model(c), nnx.Param)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  tokens = jax.ShapeDtypeStruct((c.train.batch_size, c.data.seq_len), jnp.int32)
  batch = {"input_ids": tokens, "attention_mask": tokens, "labels": tokens}
  return xla_cost(lambda p, b: lm_loss(nnx.merge(graphdef, p), b, train=True)[0], params, batch)


def relative(xla: float, analytic: float) -> float:
  return xla / analytic - 1.0


def run(config="configs/moc.py:262k", batch_size=1, overrides=None, scanned=True) -> dict:
  cfg, _ = common.load(config, batch_size, overrides)
  est = flops.estimate(cfg, cfg.train.batch_size, recompute=False)["forward"]
  unrolled = forward_cost(cfg, scan_layers=False)
  parts = {}
  for comp in common.components(cfg, abstract=True):
    cost = xla_cost(comp.fn, comp.state, comp.h)
    parts[comp.name] = {"count": comp.count, "analytic": comp.analytic_forward, "xla": cost["flops"],
                        "xla_transcendentals": cost["transcendentals"],
                        "relative": relative(cost["flops"], comp.analytic_forward),
                        "xla_minus_analytic_x_count": comp.count * (cost["flops"] - comp.analytic_forward)}
  value = relative(unrolled["flops"], est["total"])
  result = {"name": "xla_vs_analytic", "config": config, "overrides": overrides or {},
            "batch": [cfg.train.batch_size, cfg.data.seq_len],
            "analytic_forward": est["total"], "analytic_matmul": est["matmul"],
            "analytic_elementwise": est["elementwise"], "xla_forward": unrolled["flops"],
            "xla_minus_analytic_matmul": unrolled["flops"] - est["matmul"],
            "xla_transcendentals": unrolled["transcendentals"], "relative": value, "components": parts,
            "components_xla_sum": sum(p["count"] * p["xla"] for p in parts.values()),
            "goal": f"|relative| <= {GOAL}", "pass": abs(value) <= GOAL}
  if scanned and moc_jax.config.layer_plan(cfg).scanned:
    result["xla_forward_scanned"] = forward_cost(cfg, scan_layers=True)["flops"]
  return result


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), args.scanned))


if __name__ == "__main__":
  main()
