"""The errors a user can fix: each message names the field, file or flag and the fix.

Every `python -m moc_jax...` entry point catches `MocJaxError` alone (moc_jax/cli.py) and turns it into one
`error:` line and exit code 2; anything else is a bug and keeps its traceback. The subclasses also derive
from the built-in class their callers have always caught (`ValueError` for configs, `RuntimeError` for the
rest), so `except ValueError` around a config load keeps working.
"""
from __future__ import annotations


class MocJaxError(Exception):
  """Bad input a user can fix; the message says how."""


class ConfigError(MocJaxError, ValueError):
  """A config field (or command-line flag) is inconsistent; the message names the field and the fix."""


class DataError(MocJaxError, RuntimeError):
  """A dataset, split, file or tokenizer is missing or inconsistent; the message says how to fix it."""


class CheckpointError(MocJaxError, RuntimeError):
  """A checkpoint is missing, incomplete or does not match the config; nothing was overwritten."""


class CorruptCheckpointError(CheckpointError):
  """A saved step cannot be read back as it was written (unreadable, truncated, items missing, or arrays whose
  checksums differ): the step is damaged, not the config; training sets it aside and resumes from an older one."""


class TrainingError(MocJaxError, RuntimeError):
  """The run cannot continue (e.g. too many consecutive non-finite updates); nothing bad was saved."""


class UsageError(MocJaxError, ValueError):
  """A command-line argument outside the config (a prompt, a sampling flag) is invalid."""
