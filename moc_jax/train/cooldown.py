"""Cool-downs: where a shorter run would have ended, measured inside the longer one.

A warm-up / hold / decay schedule holds the learning rate at its peak until its decay starts at a fraction of the
steps (train.decay_start_ratio): up to the start of its own decay, a shorter run with the same schedule is, update for
update and document for document, the start of the longer one. `train.cooldowns` names such shorter runs as
fractions of train.steps (config.plan.cooldown_branches). When the run reaches the update where one of them starts
its decay, it saves a checkpoint there, trains on with that run's decay over the documents it would read next,
evaluates the result as that run's final evaluation (a metrics row of split `cooldown` at the branch's step, where the
decay ended in `cooldown_end`), and restores the checkpoint: the run goes on exactly as without the cool-down. One run
so gives the annealed learning curve of several shorter ones for the price of their decays (a fifth of each at the
ratio 0.8), the way Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations")
draw scaling curves from one run at a constant rate. A run's own evaluations along the hold say little of where a
shorter run would have ended: much of what an annealed run learns shows only in its decay. (The data pipeline reads
nothing of train.steps, so the documents are the shorter run's too.)

A branch is resumable like the run: killed during one, the run resumes from the checkpoint at its start and trains
the branch again; a branch whose row the metrics hold is not trained twice.
"""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

from moc_jax import optim
from moc_jax.config.plan import cooldown_branches, shorter_run
from moc_jax.train.step import jit_train_step

log = logging.getLogger("moc_jax")
SPLIT = "cooldown"


class Branches:
  """The run's cool-downs: where each branches off and ends, the jitted step of each shorter run's optimizer (its
  schedule decays where this run's holds, compiled on first use), and what a branch needs of the run (its
  checkpointer, data iterator, evaluator and metrics)."""

  def __init__(self, config, layout, batch_sharding, idf, checkpointer, data_iter, evaluator, writer):
    self.ends = cooldown_branches(config.train)
    self._config, self._layout, self._batch_sharding, self._idf = config, layout, batch_sharding, idf
    self._checkpointer, self._data_iter, self._evaluator, self._writer = checkpointer, data_iter, evaluator, writer
    self._steps = {}

  def missed(self, start) -> list[int]:
    """The branch starts before `start` (a resumed run's step) without a result: they will not be trained."""
    return sorted(s for s in self.ends if s < start and s not in self._results())

  def off(self, step, state, next_batch, saved, stopping):
    """The cool-down off `step`, if one is due (its result not yet in the metrics): checkpointed at `step` first
    (unless `saved` there already), trained to its end on `next_batch()`'s batches, its evaluation written, the
    checkpoint restored. Returns (the state to go on from, whether `stopping()` turned true during the branch: a
    pre-emption, after which the run resumes from the checkpoint at `step` and trains the branch again)."""
    end = self.ends.get(step)
    if end is None or step in self._results():
      return state, False
    if not saved:
      self._checkpointer.save(step, state, self._data_iter)
    self._checkpointer.wait()
    consecutive = int(state["nonfinite"])  # the run's count of skipped updates in a row, which the branch's are not
    log.warning("moc_jax: cool-down from step %d to %d (the run of %d steps), then back to step %d", step, end, end,
                step)
    step_fn, every, t0 = self._train_step(end), self._config.train.log_every, time.time()
    for s in range(step + 1, end + 1):
      if stopping():
        break
      state, metrics = step_fn(state, next_batch())
      if (s - step) % every == 0:  # a branch can take as long as a tenth of the run: it shows it is alive
        left = (time.time() - t0) / (s - step) * (end - s)
        log.warning("moc_jax: cool-down step %d/%d loss=%.4f ce=%.4f eta=%.0fs", s, end, float(metrics["loss"]),
                    float(metrics["ce"]), left)
    else:
      self._writer.write({"step": step, "split": SPLIT, "cooldown_end": end, **self._evaluator(state["params"])})
    restored = self._checkpointer.restore(step, self._layout.abstract, self._data_iter)
    nonfinite = jax.device_put(jnp.asarray(consecutive, jnp.int32), self._layout.shardings["nonfinite"])
    return {**restored, "nonfinite": nonfinite}, stopping()

  def _results(self) -> set[int]:
    return {r["step"] for r in self._writer.rows if r.get("split") == SPLIT}

  def _train_step(self, end):
    if end not in self._steps:
      short = self._config.copy_and_resolve_references()
      short.train = shorter_run(self._config.train, end)
      tx = optim.make_optimizer(short.train, self._layout.abstract["params"])
      self._steps[end] = jit_train_step(self._layout.graphdef, tx, short, self._layout.shardings,
                                        self._batch_sharding, self._idf)
    return self._steps[end]
