"""The sharding package's pure parts, each against hand counts: mesh sizes and their errors, shard counts,
chapter padding, the mesh checks of `validate_mesh`, the bank path test, the user view of padded trees,
and specs by logical name.

Everything here runs in this process without several devices: the device count is given (`mesh_shape`'s
argument, `config.num_fake_devices`), layouts on larger meshes use an AbstractMesh, and arrays live on a
one-device mesh. Compiled checks on several devices are in test_mesh.py.
"""
import collections

import jax
import numpy as np
import pytest
from flax import nnx

import moc_jax
from moc_jax import optim, sharding
from moc_jax.config import bank_shape, base_config
from moc_jax.errors import ConfigError
from tests.asserts import assert_same_bytes

# The default rules (config/schema.py), written out: the hand counts below are derived from this table.
DEFAULT_RULES = (
    ("batch", ("data", "memory", "fsdp")), ("length", None), ("layers", None), ("vocab", "tensor"),
    ("embed", ("fsdp", "memory")), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor"), ("banks", None),
    ("chapters", "memory"), ("chapter_tokens", None), ("bank_embed", "fsdp"), ("chapter_logits", None),
    ("chapter_factors", None), ("slots", "memory"), ("value_embed", None))


def config(mesh=None, rules=None, devices=0, chapters=None):
  """base_config() with `mesh` sizes, optional rules, a fake device count and a chapter count."""
  c = base_config()
  c.mesh.update(mesh or {})
  if rules is not None:
    c.logical_axis_rules = rules
  c.num_fake_devices = devices
  if chapters is not None:
    c.memory.num_chapters = chapters
  return c


def sizes(data=1, memory=1, fsdp=1, tensor=1):
  return {"data": data, "memory": memory, "fsdp": fsdp, "tensor": tensor}


def axes(spec):
  """A PartitionSpec as a tuple of tuples of mesh axes (None -> ()), so specs compare by content."""
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)


def one_device_mesh():
  return sharding.make_mesh(base_config(), jax.devices()[:1])


def test_default_rules_are_the_table_the_counts_below_assume():
  """The hand counts in this file read the rules from DEFAULT_RULES; they must be the config's rules."""
  assert sharding.rules_of(base_config()) == DEFAULT_RULES


# --- mesh_shape -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, devices, expected", [
    ({}, 8, sizes(data=8)),                                              # the default: data=-1 takes all
    ({"data": 2, "memory": -1}, 8, sizes(data=2, memory=4)),
    ({"data": 1, "fsdp": -1, "tensor": 2}, 8, sizes(fsdp=4, tensor=2)),
    ({"data": 2, "memory": 2, "fsdp": 2, "tensor": 1}, 8, sizes(data=2, memory=2, fsdp=2)),  # no fill
    ({"data": -1, "memory": 4}, 4, sizes(memory=4)),                     # the fill may resolve to 1
    ({}, 1, sizes()),
])
def test_mesh_shape_resolves_the_fill_axis(mesh, devices, expected):
  """-1 takes the devices left over by the fixed axes; fixed sizes come back unchanged."""
  assert sharding.mesh_shape(config(mesh), devices) == expected


@pytest.mark.parametrize("mesh, devices, pattern", [
    ({"data": 0}, 8, r"config\.mesh\.data: 0 is not a size"),
    ({"data": 2, "tensor": -2}, 8, r"config\.mesh\.tensor: -2 is not a size"),
    ({"data": 2, "memory": 0, "fsdp": -3}, 8, r"config\.mesh\.memory: 0"),   # the first bad axis in mesh order
    ({"data": -1, "fsdp": -1}, 8, r"config\.mesh: \['data', 'fsdp'\] are all -1"),
    ({"data": -1, "memory": 3}, 8, r"config\.mesh: 8 devices are not divisible by the fixed axes"),
    ({"data": 2, "memory": 2}, 8, r"config\.mesh: .* needs 4 devices but there are 8"),
    ({"data": 4, "tensor": 4}, 8, r"config\.mesh: .* needs 16 devices but there are 8"),
])
def test_mesh_shape_rejects_sizes_that_do_not_fit(mesh, devices, pattern):
  """A bad axis size is named by its field; two fills and device counts the sizes cannot make are named
  as config.mesh errors."""
  with pytest.raises(ConfigError, match=pattern):
    sharding.mesh_shape(config(mesh), devices)


# --- shards and padded_chapters -----------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_sizes, expected", [
    (sizes(data=8), {"batch": 8, "embed": 1, "chapters": 1, "vocab": 1, "length": 1}),
    (sizes(data=2, memory=4), {"batch": 8, "embed": 4, "chapters": 4, "vocab": 1, "length": 1}),
    (sizes(memory=2, fsdp=2, tensor=2), {"batch": 4, "embed": 4, "chapters": 2, "vocab": 2, "length": 1}),
    (sizes(fsdp=3, tensor=5), {"batch": 3, "embed": 3, "chapters": 1, "vocab": 5, "length": 1}),
])
def test_shards_multiplies_the_sizes_of_the_rule_axes(mesh_sizes, expected):
  """Under the default rules: batch = data*memory*fsdp, embed = fsdp*memory, chapters = memory,
  vocab = tensor, and a replicated name (length -> None) is one shard."""
  c = config()
  assert {name: sharding.shards(c, name, mesh_sizes) for name in expected} == expected


def test_shards_of_a_name_without_a_rule_is_one():
  assert sharding.shards(config(), "no_such_axis", sizes(data=2, memory=4)) == 1


def test_shards_reads_config_mesh_and_counts_devices_only_for_a_fill_axis():
  """data=-1 with 8 fake devices and memory=4: chapters (memory only) is 4 from config.mesh as written,
  and batch resolves data to 8/4 = 2, so 2*4*1 = 8."""
  c = config({"data": -1, "memory": 4}, devices=8)
  assert sharding.shards(c, "chapters") == 4
  assert sharding.shards(c, "batch") == 8
  assert sharding.shards(c, "embed") == 4


def test_shards_follows_custom_rules():
  """A rule naming several axes multiplies them; one naming a single axis takes its size."""
  rules = (("batch", "data"), ("chapters", ("memory", "fsdp")), ("heads", "tensor"))
  s = sizes(data=2, memory=3, fsdp=2, tensor=5)
  assert [sharding.shards(config(rules=rules), n, s) for n in ("batch", "chapters", "heads")] == [2, 6, 5]


@pytest.mark.parametrize("chapters, rules, mesh_sizes, expected", [
    (65, None, sizes(memory=8), 72),        # ceil(65/8) = 9 -> 9*8
    (65, None, sizes(data=2, memory=4), 68),  # ceil(65/4) = 17 -> 17*4
    (65, None, sizes(data=8), 65),          # chapters not split
    (65, None, sizes(memory=5), 65),        # 65 = 13*5 divides
    (64, None, sizes(memory=8), 64),
    (65, (("batch", ("memory", "fsdp")), ("chapters", ("memory", "fsdp"))), sizes(memory=2, fsdp=3), 66),  # 11*6
    (65, (("batch", "memory"), ("chapters", None)), sizes(memory=8), 65),   # chapters replicated
])
def test_padded_chapters_rounds_up_to_the_chapter_shards(chapters, rules, mesh_sizes, expected):
  c = config(rules=rules, chapters=chapters)
  assert sharding.padded_chapters(c, bank_shape(c), mesh_sizes) == expected


# --- validate_mesh -------------------------------------------------------------------------------------------

def test_validate_mesh_accepts_dimensions_that_divide():
  """8 fake devices as data=2 x memory=4: embed 64 and batch 16 divide their 4 and 8 shards."""
  c = config({"data": 2, "memory": 4}, devices=8)
  sharding.validate_mesh(c, {"embed": [("model.d_model", 64)], "batch": [("train.batch_size", 16)]})


def test_validate_mesh_names_unknown_mesh_axes_in_the_rules():
  rules = (("batch", "data"), ("heads", ("tensor", "pipeline")))
  with pytest.raises(ConfigError, match=r"config\.logical_axis_rules: 'heads' maps to unknown mesh axes "
                                        r"\['pipeline'\]"):
    sharding.validate_mesh(config(rules=rules, devices=2), {})


@pytest.mark.parametrize("dims, pattern", [
    ({"heads": [("model.num_heads", 6)]}, r"config\.model\.num_heads: 6 is not divisible by the 4 shards of "
                                          r"logical axis 'heads'"),
    # the first field divides, the second does not: the second is named
    ({"heads": [("model.num_heads", 8), ("memory.num_heads", 2)]}, r"config\.memory\.num_heads: 2 .* 4 shards"),
    # batch = data*memory*fsdp = 2*1*1 on this mesh
    ({"batch": [("train.batch_size", 3)]}, r"config\.train\.batch_size: 3 .* 2 shards of logical axis 'batch'"),
])
def test_validate_mesh_names_a_dimension_its_shards_do_not_divide(dims, pattern):
  """8 fake devices as data=2 x tensor=4 (heads -> tensor: 4 shards)."""
  with pytest.raises(ConfigError, match=pattern):
    sharding.validate_mesh(config({"data": 2, "tensor": 4}, devices=8), dims)


@pytest.mark.parametrize("rules, mesh, split", [
    ((("batch", "data"), ("chapters", "memory")), {"data": 2, "memory": 4}, r"\['memory'\]"),
    ((("batch", ("data", "memory")), ("chapters", ("memory", "fsdp"))), {"data": 2, "memory": 2, "fsdp": 2},
     r"\['fsdp', 'memory'\]"),
])
def test_validate_mesh_rejects_chapters_split_over_an_axis_batch_is_not(rules, mesh, split):
  """Chapters split over a mesh axis missing from 'batch' are refused, naming every mesh axis of size > 1
  that splits them."""
  with pytest.raises(ConfigError, match=r"config\.logical_axis_rules: the bank's chapters are split over "
                                        + split + r" but 'batch' is not"):
    sharding.validate_mesh(config(mesh, rules=rules, devices=8), {})


def test_validate_mesh_rejects_value_slots_split_over_an_axis_batch_is_not():
  """A product-key value table (memory.kind pkm / hml) splits its slots as the chapter bank splits chapters."""
  c = config({"data": 2, "memory": 4}, rules=(("batch", "data"), ("slots", "memory")), devices=8)
  c.memory.kind = "pkm"
  with pytest.raises(ConfigError, match=r"the bank's value slots are split over \['memory'\] but 'batch' is not"):
    sharding.validate_mesh(c, {})
  c.memory.kind = "chapters"  # the chapter bank: its chapters are not split by these rules
  sharding.validate_mesh(c, {})


@pytest.mark.parametrize("kind, sub_keys, mesh_sizes, expected", [
    ("pkm", 3, sizes(memory=2), 10),   # 9 slots on 2 shards
    ("pkm", 3, sizes(memory=4), 12),
    ("hml", 4, sizes(memory=8), 16),   # 16 slots divide 8 shards
    ("pkm", 3, sizes(data=8), 9),      # slots not split
])
def test_padded_rows_of_a_value_table_round_its_slots_up(kind, sub_keys, mesh_sizes, expected):
  c = config()
  c.memory.update(kind=kind, pkm_sub_keys=sub_keys)
  assert sharding.padded_chapters(c, bank_shape(c), mesh_sizes) == expected


@pytest.mark.parametrize("rules, mesh", [
    ((("batch", "data"), ("chapters", "memory")), {"data": 8, "memory": 1}),       # memory of size 1 splits nothing
    ((("batch", ("data", "memory")), ("chapters", "memory")), {"data": 2, "memory": 4}),
])
def test_validate_mesh_accepts_chapters_split_only_over_batch_axes(rules, mesh):
  sharding.validate_mesh(config(mesh, rules=rules, devices=8), {})


def test_validate_mesh_reports_a_mesh_that_does_not_fit_the_devices():
  with pytest.raises(ConfigError, match=r"config\.mesh: 8 devices are not divisible"):
    sharding.validate_mesh(config({"data": -1, "memory": 3}, devices=8), {})


# --- ChapterPadding and map_bank -----------------------------------------------------------------------------

def test_chapter_padding_is_active_only_when_chapters_were_added():
  assert not sharding.ChapterPadding(65, 65).active
  assert sharding.ChapterPadding(65, 72).active
  assert sharding.ChapterPadding(1, 2).active


Adam = collections.namedtuple("Adam", "count mu nu")


def test_map_bank_flags_exactly_the_bank_memory_paths():
  """`bank` directly followed by `memory`, through dicts and namedtuple attributes (Adam moments); not a
  group named "bank", a `memory` leaf elsewhere, nor the two names apart or in the other order."""
  tree = {"params": {"bank": {"memory": 1}, "memory": {"bank": 2}, "layers": {"memory": {"q": 3}}},
          "opt": Adam(count=4, mu={"bank": {"memory": 5}}, nu={"bank": {"memory": 6}}),
          "groups": {"bank": {"scale": 7, "inner": {"memory": 8}}}}
  flags = sharding.map_bank(lambda x, bank: bank, tree)
  expected = {"params": {"bank": {"memory": True}, "memory": {"bank": False}, "layers": {"memory": {"q": False}}},
              "opt": Adam(count=False, mu={"bank": {"memory": True}}, nu={"bank": {"memory": True}}),
              "groups": {"bank": {"scale": False, "inner": {"memory": False}}}}
  assert flags == expected


def test_map_bank_passes_the_other_trees_leaves_in_order():
  tree = {"bank": {"memory": 10}, "w": 20}
  out = sharding.map_bank(lambda x, y, z, bank: (x, y, z, bank), tree, {"bank": {"memory": 1}, "w": 2},
                          {"bank": {"memory": 3}, "w": 4})
  assert out == {"bank": {"memory": (10, 1, 3, True)}, "w": (20, 2, 4, False)}


def test_map_bank_finds_the_bank_in_the_models_params_and_adam_moments():
  """On the tiny MoC model (one bank of 65 chapters x 16 tokens x 64): one flagged parameter, and in the
  optimizer state exactly the two Adam moments of that parameter, all of the bank's shape."""
  cfg = moc_jax.load_config("configs/moc.py:tiny")
  params = nnx.state(moc_jax.abstract_model(cfg), nnx.Param)
  opt = jax.eval_shape(optim.make_optimizer(cfg.train, params).init, params)
  for tree, count in ((params, 1), (opt, 2)):
    shapes = [x.shape for x in jax.tree.leaves(sharding.map_bank(lambda x, bank: x if bank else None, tree))]
    assert shapes == [(1, 65, 16, 64)] * count


# --- pad_tree / unpad_tree / user_view_abstract ------------------------------------------------------------

def user_tree(mesh, chapters=5, seed=0):
  """The user view of a state: a bank [banks=2, chapters, T=3, d=4] (with -0.0, inf and nan, so equality
  of bytes is stricter than equality of values), an Adam moment of it, and non-bank leaves whose axis 1
  also has `chapters` entries."""
  rng = np.random.default_rng(seed)
  bank = rng.standard_normal((2, chapters, 3, 4)).astype(np.float32)
  bank[0, 0, 0, :3] = (-0.0, np.inf, np.nan)
  put = lambda x, spec=jax.P(): jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  return {"params": {"bank": {"memory": put(bank, jax.P(None, "memory"))},
                     "w": put(rng.standard_normal((2, chapters)).astype(np.float32))},
          "opt_state": {"mu": {"bank": {"memory": put(-bank)}},
                        "groups": {"bank": {"count": put(np.arange(2 * chapters, dtype=np.int32).reshape(2, -1))}}}}


def test_pad_then_unpad_is_bit_identical_and_pads_with_zero_chapters():
  """5 real chapters padded to 8: bank leaves gain 3 zero chapters after the real ones (unchanged bytes),
  non-bank leaves keep their shape and bytes, and cutting back gives the user view bit for bit."""
  mesh = one_device_mesh()
  user = user_tree(mesh)
  pad = sharding.ChapterPadding(5, 8)
  shardings = jax.tree.map(lambda x: x.sharding, user)
  padded = sharding.pad_tree(user, pad, shardings)
  for path in (("params", "bank", "memory"), ("opt_state", "mu", "bank", "memory")):
    leaf, ref = padded, user
    for k in path:
      leaf, ref = leaf[k], ref[k]
    leaf, ref = np.asarray(leaf), np.asarray(ref)
    assert leaf.shape == (2, 8, 3, 4)
    assert leaf[:, :5].tobytes() == ref.tobytes()
    assert leaf[:, 5:].tobytes() == np.zeros((2, 3, 3, 4), np.float32).tobytes()  # +0.0, not just == 0
  assert_same_bytes(padded["params"]["w"], user["params"]["w"])
  assert_same_bytes(padded["opt_state"]["groups"], user["opt_state"]["groups"])
  assert_same_bytes(sharding.unpad_tree(padded, pad), user)


def test_inactive_padding_leaves_trees_as_they_are():
  mesh = one_device_mesh()
  user = user_tree(mesh)
  pad = sharding.ChapterPadding(5, 5)
  assert sharding.pad_tree(user, pad, jax.tree.map(lambda x: x.sharding, user)) is user
  assert sharding.unpad_tree(user, pad) is user
  assert sharding.user_view_abstract(user, pad) is user


def abstract_bank(shape, spec, mesh_sizes):
  mesh = jax.sharding.AbstractMesh(tuple(mesh_sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES)
  return jax.ShapeDtypeStruct(shape, np.float32, sharding=jax.sharding.NamedSharding(mesh, spec))


@pytest.mark.parametrize("shape, spec, mesh_sizes, user_spec", [
    # memory=4 moves off the chapter axis to the first other dimension it divides: T=16 (1 does not)
    ((1, 8, 16, 64), jax.P(None, "memory"), sizes(memory=4), ((), (), ("memory",), ())),
    # it joins an axis already there when the product divides: 16 % (2*4) == 0
    ((1, 8, 16, 64), jax.P(None, "memory", "tensor"), sizes(memory=4, tensor=2), ((), (), ("tensor", "memory"), ())),
    # banks=4 is the first dimension memory=4 divides
    ((4, 8, 16, 64), jax.P(None, "memory", None, "fsdp"), sizes(memory=4, fsdp=2), (("memory",), (), (), ("fsdp",))),
    # nothing else divides by 4: replicated over memory
    ((1, 8, 3, 5), jax.P(None, "memory"), sizes(memory=4), ((), (), (), ())),
])
def test_user_view_abstract_cuts_chapters_and_moves_their_split(shape, spec, mesh_sizes, user_spec):
  """Restore targets of a bank padded to 8 chapters with 5 real ones: chapter axis 5, other axes and dtype
  kept, the chapter axis's mesh axes moved as hand-worked in each case; non-bank leaves untouched."""
  bank = abstract_bank(shape, spec, mesh_sizes)
  other = abstract_bank((3, 8), jax.P(None, "memory"), mesh_sizes)
  view = sharding.user_view_abstract({"bank": {"memory": bank}, "w": other}, sharding.ChapterPadding(5, 8))
  got = view["bank"]["memory"]
  assert (got.shape, got.dtype) == ((shape[0], 5, *shape[2:]), np.float32)
  assert axes(got.sharding.spec) == user_spec
  assert view["w"] is other


# --- specs by logical name (constrain.py) ----------------------------------------------------------------------

def test_batch_spec_splits_the_first_axis_over_the_batch_rule():
  assert axes(sharding.batch_spec(DEFAULT_RULES)) == (("data", "memory", "fsdp"),)
  assert axes(sharding.batch_spec((("batch", "data"),))) == (("data",),)
  assert axes(sharding.batch_spec((("length", None),))) == ((),)


def test_logical_spec_and_current_drop_mesh_axes_of_size_one():
  """On data=2 x memory=4 (fsdp=tensor=1): batch -> (data, memory), embed -> (memory,) (fsdp is 1),
  length -> not split; outside a mesh `current` reports nothing."""
  mesh = jax.sharding.AbstractMesh((2, 4, 1, 1), sharding.MESH_AXES)
  with jax.sharding.use_abstract_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
    spec = sharding.logical_spec(mesh, "batch", "length", "embed", None)
    assert sharding.current("chapters") == (("memory",), mesh)
    assert sharding.current("vocab") == ((), mesh)
  assert axes(spec) == (("data", "memory"), (), ("memory",), ())
  assert sharding.current("chapters") == ((), None)


def test_constrain_is_the_identity_outside_a_mesh():
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  assert sharding.constrain(x, "batch", None) is x


def test_shard_bytes_counts_the_largest_shard_per_leaf():
  """[1, 8, 16, 64] float32 split 4 ways on chapters: 1*2*16*64*4 bytes; [3, 5] int32 replicated: 60."""
  mesh_sizes = sizes(memory=4)
  tree = {"bank": abstract_bank((1, 8, 16, 64), jax.P(None, "memory"), mesh_sizes),
          "n": jax.ShapeDtypeStruct((3, 5), np.int32)}
  assert sharding.shard_bytes(tree) == 1 * 2 * 16 * 64 * 4 + 3 * 5 * 4
