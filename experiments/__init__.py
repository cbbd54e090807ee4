"""The studies beside the moc_jax library: sweeps, the routing evidence and retention harnesses, and the
benchmarks. They import moc_jax and run from the repository root (`python -m experiments.<study>`); the
library never imports them and the wheel does not ship them."""
