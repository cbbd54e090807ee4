"""What every `python -m moc_jax...` command shares: absl flags, quiet libraries, fake CPU devices, and bad
input turned into one `error:` line and exit code 2.

A command defines its flags at import time of its `__main__` block and calls `run(main)`. `run` resolves
`--config=configs/X.py:ARG` against the working directory first and then the configs packaged with
moc_jax (config/load.py), so the same command line works from any directory; a bad flag, a `--config.`
override naming no field, or any `MocJaxError` raised by the command is reported as one line naming the
fix, with exit code 2. Other exceptions are bugs and keep their traceback.

A command whose `main(argv)` is also called from Python (tests import every benchmark at once, and they
share flag names such as --config) defines its flags on its own `command_flags(__doc__)` instead of absl's
global FLAGS, parses them with `parse_command(flag_values, argv)`, and wraps `main` in `exit_on_error`:
the same flags library, help (`--helpfull`) and error line.
"""
from __future__ import annotations

import functools
import logging
import re
import sys

from absl import app, flags

from moc_jax.errors import MocJaxError


def run(main, argv=None):
  """absl's `app.run(main)` with this module's flag parser and error handling."""
  app.run(_reporting(main), argv, flags_parser=parse_flags)


def exit_on_error(main):
  """For commands parsed with `parse_command`: `MocJaxError` -> one `error:` line, exit code 2."""
  return _reporting(main)


def _reporting(main):
  @functools.wraps(main)
  def wrapped(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except MocJaxError as e:
      _exit_bad_input(str(e))
  return wrapped


def parse_flags(argv):
  """absl's flag parser for `app.run(..., flags_parser=parse_flags)`, after resolving `--config=PATH:ARG`:
  a bad flag, or a `--config.` override naming no field (ml_collections raises AttributeError / KeyError
  while parsing), is one `error:` line and exit 2, not a traceback."""
  try:
    return flags.FLAGS(_resolve_config_flag(argv))
  except MocJaxError as e:  # the config file is not found
    _exit_bad_input(str(e))
  except flags.Error as e:
    _exit_bad_flag(e)
  except (AttributeError, KeyError) as e:
    _exit_no_field(e, argv)


def command_flags(doc):
  """A command's own `FlagValues`: its flags cannot clash with another command's imported in the same
  process, as they would in absl's global FLAGS. `--help` / `--helpfull` print `doc` and these flags."""
  flag_values = flags.FlagValues()
  for name, short_name in (("help", "?"), ("helpshort", None), ("helpfull", None)):
    flags.DEFINE_flag(_HelpFlag(name, short_name, doc, flag_values), flag_values=flag_values)
  return flag_values


def parse_command(flag_values, argv=None):
  """`flag_values` (from `command_flags`) parsed from `argv` (None: sys.argv[1:]) and returned. Flags not
  given take their defaults, also on a second call; a bad flag, or an argument that is no flag's value
  (`--input a b`: absl takes one value per flag, so b would be silently dropped), is one `error:` line and
  exit 2, as in `parse_flags`."""
  argv = sys.argv[1:] if argv is None else list(argv)
  flag_values.unparse_flags()
  try:
    extra = flag_values([sys.argv[0], *argv])[1:]
  except flags.Error as e:
    _exit_bad_flag(e)
  if extra:
    _exit_bad_input(f"not a flag: {' '.join(extra)} (a flag with several values is repeated: --flag=a --flag=b; "
                    "--helpfull lists the flags)")
  return flag_values


class _HelpFlag(flags.BooleanFlag):
  """`--help` of a `command_flags` command: absl's own help flags would list the global FLAGS instead.
  Prints absl's help layout (the command's docstring, then its flags) on stdout and exits 0."""

  def __init__(self, name, short_name, doc, flag_values):
    super().__init__(name, False, "show this help", short_name=short_name)
    self._doc, self._flag_values = doc, flag_values

  def parse(self, argument):
    if self._parse(argument):
      print(f"{self._doc}\nflags:\n{self._flag_values.get_help()}")
      sys.exit(0)


def _resolve_config_flag(argv):
  """`--config=configs/moc.py:tiny` (or `--config configs/...`) with the path resolved by
  `config.resolve_path`; `--config.a.b=v` overrides and other flags untouched."""
  from moc_jax.config import resolve_path
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      prefix, value = "--config=", arg[len("--config="):]
    elif arg == "--config" and i + 1 < len(out):
      prefix, value, i = "", out[i + 1], i + 1
    else:
      continue
    path, sep, rest = value.partition(":")
    if path.endswith(".py"):
      out[i] = prefix + resolve_path(path) + sep + rest
  return out


def define_config_file_flag(help_text):
  """`--config=PATH.py[:ARG]` (a config file, resolved by `parse_flags`) with `--config.a.b=v` overrides;
  the config is locked: an override naming no field is an error, not a new field."""
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, help_text, lock_config=True)


def define_overrides_flag(default, help_text):
  """`--config.a.b=v` overrides of `default` (a run's saved config): ml_collections' DEFINE_config_dict, which
  parses sys.argv's overrides at once, a field it lacks reported as `parse_flags` does."""
  from ml_collections import config_flags
  try:
    config_flags.DEFINE_config_dict("config", default, help_text, lock_config=False)
  except (AttributeError, KeyError) as e:
    _exit_no_field(e, sys.argv)


def override_values():
  """The `--config.a.b=v` overrides given on the command line, as {dotted field: value}."""
  from ml_collections import config_flags
  return config_flags.get_override_values(flags.FLAGS["config"])


def begin(argv, datasets=True):
  """What a command does first: refuse stray positional arguments, quiet the libraries (and TFDS's bars)."""
  from moc_jax.errors import UsageError
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}")
  quiet_libraries()
  if datasets:
    quiet_datasets()


def run_config(workdir, overrides, what="a training run"):
  """The saved config of the run in `workdir` (`--workdir`) with `overrides`, on this machine's devices (fake
  ones if it says so), validated and locked."""
  from moc_jax.config import load_run_config, validate
  from moc_jax.errors import ConfigError
  if not workdir:
    raise ConfigError(f"--workdir=DIR is required: the directory of {what} (config.json, checkpoints/)")
  config = load_run_config(workdir, overrides)
  use_fake_devices(config.num_fake_devices)
  validate(config)
  config.lock()
  return config


def quiet_libraries():
  """Library INFO chatter (absl, orbax, tfds progress bars) off the console; moc_jax's own log at INFO. Before the
  first use of a JAX backend: an installed libtpu (the `tpu` extra) on a host without TPU chips would warn at every
  start that it cannot find the TPU VM's metadata (`tpu_topology.host_defaults`)."""
  from absl import logging as absl_logging

  from moc_jax import tpu_topology
  tpu_topology.host_defaults()
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("moc_jax").setLevel(logging.INFO)


def quiet_datasets():
  """TFDS progress bars off (commands that read data)."""
  import tensorflow_datasets as tfds
  tfds.disable_progress_bar()


def use_fake_devices(n):
  """`config.num_fake_devices`: a CPU with n devices stands in for a slice (compile reports, tests); must
  run before the first use of a JAX backend."""
  if n:
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _exit_no_field(e, argv):
  detail = " ".join(re.sub(r"\\[n']|[\n'\"]", " ", str(e.args[0] if e.args else e)).split())
  overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
  _exit_bad_input(f"a --config override names no config field ({detail}); overrides given: {', '.join(overrides)}")


def _exit_bad_flag(e):
  text = str(e)
  if _CONFIG_FILE_FAILED in text:  # ml_collections puts the config's own traceback in the message: keep its error
    last = [line for line in text.splitlines() if line.strip()][-1]
    _exit_bad_input(re.sub(r"^[\w.]*(Error|Exception): ", "", last))
  _exit_bad_input(f"{text} (--helpfull lists the flags)")


_CONFIG_FILE_FAILED = "Error whilst parsing config file"  # ml_collections' words when get_config raised


def _exit_bad_input(message):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)
