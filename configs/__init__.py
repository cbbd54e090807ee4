"""The configs packaged with moc_jax (`moc_jax.configs` once installed): files loaded by path, never imported
as modules (`--config=configs/moc.py:tiny` resolves against the working directory first, then this copy)."""
