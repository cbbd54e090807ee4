"""The repository's configs/ ships inside the wheel as the package `moc_jax.configs`, so
`--config=configs/moc.py:tiny` resolves from any directory once moc_jax is installed (setup.cfg holds
everything else)."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["moc_jax*", "kernels_pallas*"]), "moc_jax.configs"],
      package_dir={"moc_jax.configs": "configs"},
      package_data={"moc_jax.configs": ["mocpt_examples/*.yaml"]})
