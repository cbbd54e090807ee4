"""Where logical axis names meet the device mesh: the mesh and its rules (mesh.py), shardings and activation
constraints by logical name (constrain.py), and the bank's chapter padding (padding.py)."""
from moc_jax.sharding.constrain import (batch_spec, constrain, current, data_sharding, logical_shardings,
                                        logical_spec, shard_bytes)
from moc_jax.sharding.mesh import (MESH_AXES, activate, make_mesh, mesh_axes_of, mesh_shape, num_devices, rules_of,
                                   shards, validate_mesh)
from moc_jax.sharding.padding import ChapterPadding, map_bank, pad_tree, padded_chapters, unpad_tree, user_view_abstract

__all__ = ["MESH_AXES", "ChapterPadding", "activate", "batch_spec", "constrain", "current", "data_sharding",
           "logical_shardings", "logical_spec", "make_mesh", "map_bank", "mesh_axes_of", "mesh_shape", "num_devices",
           "pad_tree", "padded_chapters", "rules_of", "shard_bytes", "shards", "unpad_tree", "user_view_abstract",
           "validate_mesh"]
