"""Loading configs: a config file by path (the working directory first, then the copy packaged with moc_jax),
dotted overrides, and a saved run's config.json read back into the schema.

Configs are code files loaded by path, not imported as a package: `configs/moc.py:tiny` names the file and
the argument its `get_config` receives. The repository's `configs/` ships inside the wheel as
`moc_jax.configs`, so the same spelling works from any directory once moc_jax is installed; a file of that
name in the working directory wins, so a user's edited copy is what runs.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
import logging
import os

from ml_collections import config_dict

from moc_jax.config.schema import base_config
from moc_jax.config.validate import validate
from moc_jax.errors import ConfigError

log = logging.getLogger("moc_jax")

CONFIGS_DIR = "configs"  # how config paths are spelled: configs/<file> (the packaged copy is moc_jax.configs)


def resolve_path(path: str) -> str:
  """`path` as given if it exists (absolute, or relative to the working directory); otherwise a
  `configs/...` path inside the packaged configs; ConfigError naming both places if neither has it."""
  if os.path.exists(path):
    return path
  parts = os.path.normpath(path).split(os.sep)
  if not os.path.isabs(path) and len(parts) > 1 and parts[0] == CONFIGS_DIR:
    packaged = importlib.resources.files("moc_jax.configs").joinpath(*parts[1:])
    if packaged.is_file():
      return str(packaged)
  raise ConfigError(f"config file {path!r} not found in the working directory {os.getcwd()!r} nor among the "
                    "configs packaged with moc_jax; pass e.g. 'configs/moc.py:tiny'")


def config_module(path: str):
  """The config file at `path` (see `resolve_path`) as a module."""
  path = os.path.abspath(resolve_path(path))
  module_spec = importlib.util.spec_from_file_location(f"_moc_cfg_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def sibling(config_file: str, name: str):
  """The config file `name`.py beside `config_file` (a config's own `__file__`) as a module: how one config
  builds on another without a package or sys.path edits (configs/vanilla.py strips configs/moc.py)."""
  return config_module(os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py"))


def load_config(spec: str, overrides: dict | None = None) -> config_dict.ConfigDict:
  """Loads `path.py[:arg]`, applies dotted `overrides`, validates, and returns a locked config."""
  path, _, arg = spec.partition(":")
  module = config_module(path)
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except ValueError as e:
    raise ConfigError(str(e)) from e
  for key, value in (overrides or {}).items():
    _set_dotted(config, key, value)
  validate(config)
  config.lock()
  return config


def _set_dotted(config, key, value):
  parent = config
  parts = key.split(".")
  for part in parts[:-1]:
    if not isinstance(parent, config_dict.ConfigDict) or part not in parent:
      raise ConfigError(f"override {key!r}: no field {part!r} in the config")
    parent = parent[part]
  if not isinstance(parent, config_dict.ConfigDict) or parts[-1] not in parent:
    known = sorted(parent.keys()) if isinstance(parent, config_dict.ConfigDict) else []
    raise ConfigError(f"override {key!r}: no field {parts[-1]!r}; known: {known}")
  try:
    parent[parts[-1]] = tuple(value) if isinstance(value, list) else value
  except TypeError as e:
    raise ConfigError(f"override {key!r}: {e}") from e


# --- a saved run's config ------------------------------------------------------------------------------

def _as_saved(value):
  """JSON lists back to the tuples the config holds."""
  return tuple(_as_saved(v) for v in value) if isinstance(value, list) else value


def _merge(config, saved, path, prefix=""):
  """Writes `saved` (a JSON object) into `config`; returns the dotted keys this version has no field for."""
  ignored = []
  for key, value in saved.items():
    name = prefix + key
    if key not in config:
      ignored.append(name)
    elif isinstance(config[key], config_dict.ConfigDict) and isinstance(value, dict):
      ignored += _merge(config[key], value, path, name + ".")
    else:
      try:
        config[key] = _as_saved(value)
      except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: field {name}={value!r} does not fit this version's config ({e}); "
                          f"override it with --config.{name}=...") from e
  return ignored


def load_run_config(workdir: str, overrides: dict | None = None) -> config_dict.ConfigDict:
  """The run's config: workdir/config.json read into the base config, the mesh reset to this machine's
  devices (data-parallel over all; a checkpoint restores onto any mesh), then dotted `overrides`.
  Not validated: validate after choosing the devices (`num_fake_devices`)."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise ConfigError(f"--workdir {workdir!r} does not exist; pass the directory of a training run "
                      "(it holds config.json and checkpoints/)")
  if not os.path.isfile(path):
    raise ConfigError(f"{path} not found: --workdir must be the directory a training run wrote (training "
                      "saves its config there); for a checkpoint without it use `python -m moc_jax.main "
                      "--mode=eval --config=... --workdir=...`")
  try:
    with open(path) as f:
      saved = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); restore it from the run or use `python -m "
                      "moc_jax.main --mode=eval --config=...`") from e
  config = base_config()
  ignored = _merge(config, saved, path)
  if ignored:
    log.warning("moc_jax: %s: ignored fields this version does not have: %s", path, ", ".join(ignored))
  base = base_config()
  config.mesh, config.num_fake_devices = base.mesh, base.num_fake_devices
  try:
    config.update_from_flattened_dict(dict(overrides or {}))
  except (KeyError, AttributeError, TypeError) as e:
    raise ConfigError(f"--config override: {e}") from e
  return config
