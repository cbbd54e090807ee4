"""P1: steady-state MFU of the production train step, and where the step's time goes.

MFU = analytic model FLOPs per step (fwd + bwd, memory read only, no remat recompute) / (median step
seconds x devices x peak). On a CPU the peak is measured in this same process, right before the step
runs, in the model's compute dtype, so both see the same machine state (this CPU is shared).
HFU adds the recompute that model.remat="full" really executes (one more forward of every layer).

The profile times the whole forward and the optimizer alone (backward + recompute is the rest of the
step), and each component the estimator counts (self-attention, MLP, memory, head) as its own jitted
forward and forward+backward at the micro-batch shape: per step, a component costs count x (fwd+bwd,
plus one more fwd under remat) x grad_accum.

`python -m experiments.bench.train_mfu [--config=configs/moc.py:small] [--steps 3] [--profile_reps 0]`
"""
from __future__ import annotations

import jax
from absl import flags

from experiments.bench import common
from moc_jax import cli, flops

GOAL = 0.5

_FLAGS = cli.command_flags(__doc__)
common.define_config_flags(_FLAGS, "configs/moc.py:small", None)
flags.DEFINE_integer("steps", 3, "timed steps", flag_values=_FLAGS)
flags.DEFINE_integer("warmup", 1, "untimed steps after compilation", flag_values=_FLAGS)
flags.DEFINE_integer("profile_reps", 2, "timed calls per profiled part; 0 = no profile", flag_values=_FLAGS)
common.define_int_list_flag(_FLAGS, "peak_sizes", common.PEAK_SIZES, "square matmul sizes of the in-process CPU peak")


def profile(trainer, reps) -> dict:
  config = trainer.config
  remat = config.model.remat != "none"
  accum = config.train.grad_accum
  comps, total = {}, 0.0
  for comp in common.components(config, abstract=False):
    fwd, fwd_bwd = jax.jit(comp.fn), jax.jit(common.forward_and_backward(comp.fn))
    t_f = common.summary(common.time_calls(lambda: fwd(comp.state, comp.h), reps))["median_s"]
    t_fb = common.summary(common.time_calls(lambda: fwd_bwd(comp.state, comp.h), reps))["median_s"]
    per_step = comp.count * accum * (t_fb + (t_f if remat and comp.name != "head" else 0.0))
    total += per_step
    comps[comp.name] = {"count": comp.count, "forward_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb,
                        "per_step_s": per_step, "forward_gflops_per_s": comp.analytic_forward / t_f / 1e9,
                        "fwd_bwd_gflops_per_s": 3 * comp.analytic_forward / t_fb / 1e9}
  return {"forward_s": common.summary(common.time_calls(trainer.forward, reps))["median_s"],
          "optimizer_s": common.summary(trainer.time_optimizer(reps))["median_s"],
          "components": comps, "components_sum_s": total}


def run(config="configs/moc.py:small", batch_size=None, overrides=None, steps=3, warmup=1, profile_reps=2,
        peak_sizes=common.PEAK_SIZES) -> dict:
  cfg, _ = common.load(config, batch_size, overrides)
  dtype = cfg.model.compute_dtype
  peak, peak_source = common.device_peak(dtype, peak_sizes)
  trainer = common.trainer(cfg)
  step = common.summary(trainer.run(steps, warmup))
  hardware = flops.estimate(cfg, cfg.train.batch_size, recompute=cfg.model.remat != "none")["train"]["step"]
  value = common.mfu(trainer.flops_per_step, step["median_s"], peak)
  result = {"name": "train_mfu", "config": config, "overrides": overrides or {},
            "global_batch": [cfg.train.batch_size * cfg.train.grad_accum, cfg.data.seq_len],
            "compute_dtype": dtype, "remat": cfg.model.remat, "compile_s": trainer.compile_s, "step": step,
            "model_flops_per_step": trainer.flops_per_step, "hardware_flops_per_step": hardware,
            "peak_flops_per_s": peak, "peak_source": peak_source, "mfu": value,
            "hfu": common.mfu(hardware, step["median_s"], peak),
            "goal": f"mfu >= {GOAL}", "pass": value is not None and value >= GOAL}
  if profile_reps:
    p = profile(trainer, profile_reps)
    p["backward_and_recompute_s"] = step["median_s"] - p["forward_s"] - p["optimizer_s"]
    result["profile"] = p
  return result


@cli.exit_on_error
def main(argv=None) -> dict:
  args = cli.parse_command(_FLAGS, argv)
  return common.emit(run(args.config, args.batch_size, common.parse_overrides(args.set), args.steps, args.warmup,
                         args.profile_reps, tuple(args.peak_sizes)))


if __name__ == "__main__":
  main()
