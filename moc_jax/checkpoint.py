"""Orbax checkpoints for everything a run saves. Item names are fixed (later tools restore them):
`params`, `opt_state`, `step`, `data_iter` (Grain iterator state), `rng`.

Saves are asynchronous; a save interrupted by SIGKILL leaves only a temporary directory that Orbax
ignores, so the newest *finished* step is always the one restored.
"""
from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from moc_jax import sharding
from moc_jax.errors import CheckpointError

ITEMS = ("params", "opt_state", "step", "data_iter", "rng")


def checkpoint_dir(workdir_or_dir: str) -> str:
  """Accepts a run's workdir or its checkpoints/ directory."""
  sub = os.path.join(workdir_or_dir, "checkpoints")
  return os.path.abspath(sub if os.path.isdir(sub) else workdir_or_dir)


class Checkpointer:
  """Saves and restores a run's state. With `padding` (chapters padded for sharding), the saved
  params and optimizer state are the user view — exactly num_chapters chapters — so a checkpoint
  restores onto any mesh."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, padding=None):
    self.directory = os.path.abspath(directory)
    self.padding = padding
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=ITEMS,
        item_handlers={"data_iter": grain.checkpoint.CheckpointHandler()},
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                             create=True))

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step: int, state: dict, data_iter=None) -> None:
    """`state` holds params, opt_state, rng and the counters step / skipped (saved as the `step` item);
    `data_iter` (a Grain iterator) is saved with them unless None."""
    view = _user_view(state, self.padding)
    items = {"params": view["params"], "opt_state": view["opt_state"], "rng": {"key": state["rng"]},
             "step": {"step": state["step"], "skipped": state["skipped"]}}
    args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
    if data_iter is not None:
      args["data_iter"] = grain.checkpoint.CheckpointSave(data_iter)
    self.manager.save(step, args=ocp.args.Composite(**args), force=True)

  def restore(self, step: int, abstract_state: dict, data_iter=None) -> dict:
    """Restores every item onto `abstract_state`'s shapes/shardings (any mesh); `data_iter`, unless
    None, is restored in place."""
    targets = {**_user_view_abstract(abstract_state, self.padding),
               "rng": {"key": abstract_state["rng"]},
               "step": {"step": abstract_state["step"], "skipped": abstract_state["skipped"]}}
    missing = [k for k in ITEMS if k != "data_iter" or data_iter is not None
               if not (epath.Path(self.directory) / str(step) / k).exists()]
    if missing:
      raise CheckpointError(f"checkpoint {self.directory} step {step} has no {', '.join(missing)} (weights only, e.g. "
                            "imported): it cannot be resumed. Evaluate it (python -m moc_jax.eval --workdir=...), or "
                            "train from it in a new --workdir with --config.train.init_from=<this workdir>")
    args = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
    if data_iter is not None:
      _check_process_count(os.path.join(self.directory, str(step), "data_iter"))
      args["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(**args))
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"checkpoint {self.directory} step {step} does not match this config ({e}); "
                            "use a fresh --workdir, or the config the run was started with "
                            "(its config.json)") from e
    return {**_device_layout({"params": out["params"], "opt_state": out["opt_state"]}, abstract_state, self.padding),
            "rng": out["rng"]["key"], **out["step"]}

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _check_process_count(data_iter_dir):
  """Each process saves its own data-iterator state: resuming needs the same process count."""
  saved = {f.rsplit("-of-", 1)[-1].removesuffix(".json") for f in os.listdir(data_iter_dir)
           if "-of-" in f} if os.path.isdir(data_iter_dir) else set()
  if saved and saved != {str(jax.process_count())}:
    raise CheckpointError(f"{data_iter_dir} was saved by {'/'.join(sorted(saved))} processes and this run has "
                          f"{jax.process_count()}; resume with that many processes, or start a new workdir with "
                          "--config.train.init_from=<this workdir> (weights only)")


def _user_view(state, padding):
  tree = {k: state[k] for k in ("params", "opt_state")}
  return tree if padding is None else sharding.unpad_tree(tree, padding)


def _user_view_abstract(abstract_state, padding):
  tree = {k: abstract_state[k] for k in ("params", "opt_state") if k in abstract_state}
  return tree if padding is None else sharding.user_view_abstract(tree, padding)


def _device_layout(tree, abstract_state, padding):
  if padding is None:
    return tree
  return sharding.pad_tree(tree, padding, jax.tree.map(lambda a: a.sharding, {k: abstract_state[k] for k in tree}))


def restore_params(directory: str, abstract_params, step: int | None = None, padding=None):
  """Weights only (for init_from / evaluation): restores the `params` item of the newest checkpoint
  onto `abstract_params`' shapes and shardings (any mesh: `padding` re-pads the chapter axis)."""
  directory = checkpoint_dir(directory)
  manager = ocp.CheckpointManager(directory, item_names=("params",))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"no checkpoint found under {directory}; point at a workdir of a run that saved one")
  try:
    target = _user_view_abstract({"params": abstract_params}, padding)["params"]
    params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"params in {directory} step {step} do not match this model config ({e})") from e
  finally:
    manager.close()
  return _device_layout({"params": params}, {"params": abstract_params}, padding)["params"], step
