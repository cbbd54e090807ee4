"""Orbax checkpoints for everything a run saves. Item names are fixed (later tools restore them):
`params`, `opt_state`, `step`, `data_iter` (Grain iterator state), `rng`.

Saves are asynchronous; a save interrupted by SIGKILL leaves only a temporary directory that Orbax
ignores, so the newest *finished* step is always the one restored.

Every step also records a manifest in its Orbax step metadata (`_CHECKPOINT_METADATA`, committed atomically
with the items): for each saved array its path, shape, dtype and a fingerprint of its bytes. A restore first
compares the manifest's shapes with the config's (a difference is a config mismatch: refused, nothing touched),
then reads the arrays and recomputes the fingerprints, so bytes flipped on disk that still decode are caught as
well as unreadable or missing files: either is a `CorruptCheckpointError`. The fingerprint is computed on device
as a position-weighted sum of the arrays' bits (mod 2**32): it does not depend on the mesh the state lives on,
and any change of a single element changes it. Steps saved without a manifest (older runs) are restored
unverified, with today's errors.

`set_aside` renames a corrupt step to `<step>.corrupt` (`<step>.corrupt.2`, ... if taken), a name Orbax does not
list as a step: nothing is deleted, and training resumes from the newest good step.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import warnings

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from moc_jax import sharding
from moc_jax.errors import CheckpointError, CorruptCheckpointError, MocJaxError

ITEMS = ("params", "opt_state", "step", "data_iter", "rng")
MANIFEST_KEY = "moc_jax_manifest"  # in the step's custom metadata: {item: {path: [shape, dtype, fingerprint]}}
CORRUPT_SUFFIX = ".corrupt"
_STEP_METADATA = "_CHECKPOINT_METADATA"


def checkpoint_dir(workdir_or_dir: str) -> str:
  """Accepts a run's workdir or its checkpoints/ directory."""
  sub = os.path.join(workdir_or_dir, "checkpoints")
  return os.path.abspath(sub if os.path.isdir(sub) else workdir_or_dir)


def saved_steps(directory: str) -> list[int]:
  """The finished steps under `directory` (an interrupted save's temporary directory is no step)."""
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def set_aside_steps(directory: str) -> list[str]:
  """Names of the steps `set_aside` renamed under `directory`."""
  return sorted(d for d in os.listdir(directory) if CORRUPT_SUFFIX in d) if os.path.isdir(directory) else []


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

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: dict, data_iter=None) -> None:
    """`state` holds params, opt_state, rng and the counters step / skipped (saved as the `step` item);
    `data_iter` (a Grain iterator) is saved with them unless None."""
    view = _user_view(state, self.padding)
    items = {"params": view["params"], "opt_state": view["opt_state"], "rng": {"key": state["rng"]},
             "step": {"step": state["step"], "skipped": state["skipped"]}}
    args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
    if data_iter is not None:
      args["data_iter"] = grain.checkpoint.CheckpointSave(data_iter)
    self.manager.save(step, args=ocp.args.Composite(**args), force=True,
                      custom_metadata={MANIFEST_KEY: manifest(items)})

  def restore(self, step: int, abstract_state: dict, data_iter=None) -> dict:
    """Restores every item onto `abstract_state`'s shapes/shardings (any mesh); `data_iter`, unless
    None, is restored in place. CorruptCheckpointError if the step is damaged; CheckpointError if it does not
    fit this config or cannot be resumed (weights only)."""
    targets = {**_user_view_abstract(abstract_state, self.padding),
               "rng": {"key": abstract_state["rng"]},
               "step": {"step": abstract_state["step"], "skipped": abstract_state["skipped"]}}
    step_dir = _step_dir(self.directory, step)
    saved = _saved_items(step_dir)
    wanted = [k for k in ITEMS if k != "data_iter" or data_iter is not None]
    unsaved = [k for k in wanted if k not in saved]
    if unsaved:
      raise CheckpointError(f"checkpoint {self.directory} step {step} has no {', '.join(unsaved)} (weights only, "
                            "e.g. imported): it cannot be resumed. Evaluate it (python -m moc_jax.eval --workdir=...), "
                            "or train from it in a new --workdir with --config.train.init_from=<this workdir>")
    args = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
    if data_iter is not None:
      _check_process_count(os.path.join(step_dir, "data_iter"))
      args["data_iter"] = grain.checkpoint.CheckpointRestore(data_iter)
    out = _verified_restore(self.manager, self.directory, step, targets, args)
    return {**_device_layout({"params": out["params"], "opt_state": out["opt_state"]}, abstract_state, self.padding),
            "rng": out["rng"]["key"], **out["step"]}

  def set_aside(self, step: int) -> str:
    """Renames corrupt `step` to a name Orbax lists as no step (nothing is deleted) and returns the new path;
    process 0 renames, every process waits for it."""
    target = _free_name(os.path.join(self.directory, f"{step}{CORRUPT_SUFFIX}"))
    if jax.process_index() == 0:
      os.rename(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"moc_jax set aside {step}")
    self.manager.reload()
    return target

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def manifest(items: dict) -> dict:
  """{item: {path: [shape, dtype, fingerprint]}} of the arrays in `items` (item name -> pytree)."""
  sums = jax.device_get(_fingerprints(items))
  return {item: {path: [*spec, int(s)] for (path, spec), s in zip(_layout(tree).items(), jax.tree.leaves(sums[item]))}
          for item, tree in items.items()}


def _layout(tree) -> dict:
  """{path: [shape, dtype]} of `tree`'s leaves (arrays or ShapeDtypeStructs), as JSON stores them."""
  return {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@jax.jit
def _fingerprints(tree):
  return jax.tree.map(_fingerprint, tree)


def _fingerprint(x):
  """sum_i bits_i * (i * golden | 1) mod 2**32 over the flattened array: an integer sum, so the same on any
  mesh; each weight is odd, so a change of any one element changes it. An array in host memory
  (train.bank_state_memory) is summed on the device, one array at a time."""
  if jax.typeof(x).memory_space == jax.memory.Space.Host:
    x = jax.device_put(x, jax.memory.Space.Device)
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
  weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(0x9E3779B1) | jnp.uint32(1)
  return jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)


def _step_dir(directory, step):
  path = os.path.join(directory, str(step))
  if not os.path.isdir(path):
    raise CheckpointError(f"no checkpoint of step {step} under {directory}; saved steps: {saved_steps(directory)}")
  return path


def _step_metadata(step_dir) -> dict:
  """The step's Orbax metadata (items saved, our manifest); a step without readable metadata is corrupt."""
  try:
    with open(os.path.join(step_dir, _STEP_METADATA)) as f:
      meta = json.load(f)
    return {"items": set(meta["item_handlers"]), "manifest": (meta.get("custom_metadata") or {}).get(MANIFEST_KEY)}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"checkpoint {step_dir}: its step metadata cannot be read ({e})") from None


def _saved_items(step_dir) -> set:
  """The items the step was saved with; one saved but absent on disk makes the step corrupt."""
  items = _step_metadata(step_dir)["items"]
  gone = sorted(k for k in items if not os.path.isdir(os.path.join(step_dir, k)))
  if gone:
    raise CorruptCheckpointError(f"checkpoint {step_dir}: items {', '.join(gone)} were saved but are missing")
  return items


def _verified_restore(manager, directory, step, targets, args):
  """`manager.restore` checked against the step's manifest: shapes first (a mismatch is this config's, the
  step is not touched), then every array's fingerprint after reading it (a difference is corruption)."""
  step_dir = os.path.join(directory, str(step))
  saved = _step_metadata(step_dir)["manifest"]
  if saved is not None:
    _check_layout(saved, targets, step_dir)
  out, error = _quiet_restore(manager, step, args)
  if error is not None and saved is None:  # unverified (no manifest): corruption and another config look alike
    raise CheckpointError(f"checkpoint {directory} step {step} does not match this config or cannot be read "
                          f"({error}); use a fresh --workdir, or the config the run was started with (its config.json)")
  if error is not None:
    raise CorruptCheckpointError(f"checkpoint {step_dir} cannot be read ({error})")
  if saved is not None:
    _check_fingerprints(saved, {k: out[k] for k in targets}, step_dir)
  return out


def _check_layout(saved, targets, step_dir):
  """The saved arrays' paths, shapes and dtypes against the config's: CheckpointError (not corruption) if
  they differ."""
  diffs = []
  for item, tree in targets.items():
    want, got = _layout(tree), {p: spec[:2] for p, spec in saved.get(item, {}).items()}
    diffs += [f"{item}{p} saved {_spec(got.get(p))}, this config {_spec(want.get(p))}"
              for p in sorted(set(want) | set(got)) if want.get(p) != got.get(p)]
  if diffs:
    raise CheckpointError(f"checkpoint {step_dir} does not match this config ({len(diffs)} arrays differ: "
                          f"{'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}); use a fresh --workdir, or the "
                          "config the run was started with (its config.json)")


def _spec(spec):
  return "nothing" if spec is None else f"{tuple(spec[0])} {spec[1]}"


def _check_fingerprints(saved, restored, step_dir):
  got = manifest(restored)
  bad = [f"{item}{p}" for item in restored for p in saved[item] if saved[item][p] != got[item].get(p)]
  if bad:
    raise CorruptCheckpointError(f"checkpoint {step_dir}: {len(bad)} arrays differ from what was saved "
                                 f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")


def _quiet_restore(manager, step, args):
  """(restored items, None), or (None, a one-line description of the error). A failed Orbax restore abandons
  its other reads on a closed event loop; they are collected here, inside this call, with their
  'Event loop is closed' complaints dropped, instead of printing tracebacks when the interpreter exits."""
  try:
    return manager.restore(step, args=ocp.args.Composite(**args)), None
  except MocJaxError:  # the data iterator refusing a state (pipeline._VersionedStateIterator) is no corruption
    _collect_abandoned_reads()
    raise
  except Exception as e:  # noqa: BLE001 - Orbax / TensorStore raise bare Exception, ValueError, OSError, ...
    error = f"{type(e).__name__}: {str(e).splitlines()[0].split(' See full TensorStore details')[0][:300]}"
  _collect_abandoned_reads()
  return None, error


def _collect_abandoned_reads():
  with _dropping_abandoned_reads():
    gc.collect()


_PREVIOUS_HOOK = []  # the hooks `_dropping_abandoned_reads` replaced, innermost last


def _drop_abandoned_read(unraisable):
  """sys.unraisablehook while `_dropping_abandoned_reads` is active: drops Orbax's abandoned coroutines'
  complaints, hands anything else to the hook it replaced."""
  code = getattr(unraisable.object, "cr_code", None)
  if not (code and "orbax" in code.co_filename) and "Event loop is closed" not in str(unraisable.exc_value):
    (_PREVIOUS_HOOK[-1] if _PREVIOUS_HOOK else sys.__unraisablehook__)(unraisable)


@contextlib.contextmanager
def _dropping_abandoned_reads():
  """Unraisable errors of Orbax's abandoned coroutines (and their 'never awaited' warnings) are dropped;
  any other unraisable error still reaches the previous hook. The hook is a module-level function, never a
  closure that the restore could free: Orbax's worker threads can still be inside it when this context restores
  the previous hook (a worker segfaulted inside the closure this replaced)."""
  previous = sys.unraisablehook
  _PREVIOUS_HOOK.append(previous)
  sys.unraisablehook = _drop_abandoned_read
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
      yield
  finally:
    sys.unraisablehook = previous
    _PREVIOUS_HOOK.pop()


def _free_name(path):
  """`path`, or `path.2`, `path.3`, ... whichever does not exist yet."""
  candidate, n = path, 1
  while os.path.exists(candidate):
    n += 1
    candidate = f"{path}.{n}"
  return candidate


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
  """Weights only (for init_from / evaluation): restores the `params` item of the newest checkpoint (or
  `step`) onto `abstract_params`' shapes and shardings (any mesh: `padding` re-pads the chapter axis). Reads
  only: nothing is created, renamed or deleted."""
  directory = checkpoint_dir(directory)
  steps = saved_steps(directory)
  if step is None and not steps:
    raise CheckpointError(f"no checkpoint found under {directory}; point at a workdir of a run that saved one")
  step = steps[-1] if step is None else step
  step_dir = _step_dir(directory, step)
  if "params" not in _saved_items(step_dir):
    raise CorruptCheckpointError(f"checkpoint {step_dir} holds no params")
  target = {"params": _user_view_abstract({"params": abstract_params}, padding)["params"]}
  manager = ocp.CheckpointManager(directory, item_names=("params",),
                                  options=ocp.CheckpointManagerOptions(create=False))
  try:
    params = _verified_restore(manager, directory, step, target,
                               {"params": ocp.args.StandardRestore(target["params"])})["params"]
  finally:
    manager.close()
  return _device_layout({"params": params}, {"params": abstract_params}, padding)["params"], step


def write_weights(directory: str, step: int, params) -> str:
  """Saves `params` alone (with their manifest) as `step` under `directory`, as training saves them: a
  checkpoint that evaluation and `--config.train.init_from` read, not one a run resumes. Returns its path."""
  manager = ocp.CheckpointManager(directory, item_names=ITEMS, options=ocp.CheckpointManagerOptions(create=True))
  manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True,
               custom_metadata={MANIFEST_KEY: manifest({"params": params})})
  manager.wait_until_finished()
  manager.close()
  return os.path.join(directory, str(step))
