"""Importers from other codebases' checkpoints and configs."""
