"""Config loading and validation: every rejection names its field; derived facts match hand counts."""
import pytest

import moc_jax
from moc_jax.config import LayerPlan, bank_ids, base_config, layer_plan, memory_layers, routing_is_causal


def _tiny(**overrides):
  """A fresh, valid tiny MoC config (locked: existing fields may change, none may be added)."""
  return moc_jax.load_config("configs/moc.py:tiny", overrides)


def _set(c, dotted, value):
  node, name = dotted.split(".")
  c[node][name] = value


MODEL_POSITIVE = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
                  "max_seq_len", "rope_theta", "norm_eps", "init_std", "attn_out_init_std", "mlp_out_init_std")
MEMORY_POSITIVE = ("num_tokens", "num_chapters", "top_k", "num_heads", "num_kv_heads", "init_std",
                   "placement_k", "placement_n", "sharing_k", "token_norm_eps")
MEMORY_NON_NEGATIVE = ("num_shared", "routed_scaling_factor", "load_balance_coef", "z_loss_coef", "mse_aux_coef")

# (id, {field: bad value}, field the message must name). The tiny config has d_model 64, 4 layers,
# 4/2 heads, 65 chapters of 16 tokens (1 shared), top-8, 4/4 memory heads, memory at layers (1, 3).
REJECTIONS = [
    ("bank_not_divisible", {"memory.num_tokens": 65 * 16 + 1}, "memory.num_tokens"),
    ("top_k_over_routable", {"memory.top_k": 65}, "memory.top_k"),
    ("top_k_over_routable_more_shared", {"memory.num_shared": 10, "memory.top_k": 56}, "memory.top_k"),
    ("shared_eq_chapters", {"memory.num_shared": 65}, "memory.num_shared"),
    ("shared_gt_chapters", {"memory.num_shared": 70}, "memory.num_shared"),
    ("custom_index_too_high", {"memory.layer_indices": (1, 4)}, "memory.layer_indices"),
    ("custom_index_negative", {"memory.layer_indices": (-1, 2)}, "memory.layer_indices"),
    ("custom_index_repeated", {"memory.layer_indices": (1, 3, 1)}, "memory.layer_indices"),
    ("first_k_over_layers", {"memory.placement": "first_k", "memory.placement_k": 5}, "memory.placement_k"),
    ("last_k_over_layers", {"memory.placement": "last_k", "memory.placement_k": 5}, "memory.placement_k"),
    ("heads_not_dividing_d", {"model.num_heads": 3, "model.num_kv_heads": 1}, "model.num_heads"),
    ("kv_heads_not_dividing_heads", {"model.num_kv_heads": 3}, "model.num_kv_heads"),
    ("odd_head_dim", {"model.num_heads": 64, "model.num_kv_heads": 2}, "model.num_heads"),
    ("memory_heads_not_dividing_d", {"memory.num_heads": 3, "memory.num_kv_heads": 1}, "memory.num_heads"),
    ("memory_kv_heads_not_dividing", {"memory.num_kv_heads": 3}, "memory.num_kv_heads"),
    ("memory_dim_zero", {"memory.dim": 0}, "memory.dim"),
    ("memory_dim_negative", {"memory.dim": -8}, "memory.dim"),
    ("placement_none_enabled", {"memory.placement": "none"}, "memory.placement"),
    ("custom_empty", {"memory.layer_indices": ()}, "memory.placement"),
    ("unknown_placement", {"memory.placement": "middle"}, "memory.placement"),
    ("unknown_sharing", {"memory.sharing": "global"}, "memory.sharing"),
    ("unknown_block_variant", {"memory.block_variant": "C"}, "memory.block_variant"),
    ("unknown_token_norm", {"memory.token_norm": "batchnorm"}, "memory.token_norm"),
    ("unknown_routing", {"memory.routing": "rolling"}, "memory.routing"),
    ("unknown_compute_dtype", {"model.compute_dtype": "float8"}, "model.compute_dtype"),
    ("unknown_param_dtype", {"model.param_dtype": "int8"}, "model.param_dtype"),
    ("unknown_remat", {"model.remat": "selective"}, "model.remat"),
    ("unknown_hidden_activation", {"model.hidden_activation": "geglu"}, "model.hidden_activation"),
]
# data / train fields (checked before the memory fields)
REJECTIONS += [
    ("seq_len_over_max", {"data.seq_len": 257}, "data.seq_len"),
    ("train_batch_zero", {"train.batch_size": 0}, "train.batch_size"),
    ("train_steps_negative", {"train.steps": -1}, "train.steps"),
    ("train_lr_negative", {"train.base_lr": -1e-3}, "train.base_lr"),
    ("train_bank_lr_negative", {"train.bank_lr": -1.0}, "train.bank_lr"),
    ("train_bank_weight_decay_negative", {"train.bank_weight_decay": -0.1}, "train.bank_weight_decay"),
    ("train_unknown_schedule", {"train.schedule": "step"}, "train.schedule"),
    ("train_warmup_over_steps", {"train.steps": 10, "train.warmup_steps": 11}, "train.warmup_steps"),
    ("train_decay_ratio_out_of_range", {"train.decay_start_ratio": 1.5}, "train.decay_start_ratio"),
    ("train_decay_start_after_the_end", {"train.steps": 100, "train.decay_start_step": 101}, "train.decay_start_step"),
    ("train_b1_is_one", {"train.b1": 1.0}, "train.b1"),
]
for _f in MODEL_POSITIVE:
  REJECTIONS += [(f"model_{_f}_zero", {f"model.{_f}": 0}, f"model.{_f}"),
                 (f"model_{_f}_negative", {f"model.{_f}": -1}, f"model.{_f}")]
for _f in MEMORY_POSITIVE:
  REJECTIONS += [(f"memory_{_f}_zero", {f"memory.{_f}": 0}, f"memory.{_f}"),
                 (f"memory_{_f}_negative", {f"memory.{_f}": -1}, f"memory.{_f}")]
for _f in MEMORY_NON_NEGATIVE:
  REJECTIONS += [(f"memory_{_f}_negative", {f"memory.{_f}": -1}, f"memory.{_f}")]


@pytest.mark.parametrize("changes,field", [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_validate_rejects_and_names_field(changes, field):
  """Each inconsistent field must be caught by validate() with a message that names it."""
  c = _tiny()
  for key, value in changes.items():
    _set(c, key, value)
  with pytest.raises(moc_jax.ConfigError) as err:
    moc_jax.validate(c)
  assert f"config.{field}:" in str(err.value), str(err.value)


@pytest.mark.parametrize("changes", [
    {"memory.top_k": 64},                            # exactly the routable chapters
    {"memory.num_shared": 0, "memory.top_k": 65},    # no shared chapter, all routed
    {"memory.num_shared": 64, "memory.top_k": 1},    # a single routable chapter
    {"memory.load_balance_coef": 0.0, "memory.z_loss_coef": 0.0, "memory.routed_scaling_factor": 0.0},
    {"memory.placement": "first_k", "memory.placement_k": 4},
    {"memory.dim": 32},
])
def test_validate_accepts_boundaries(changes):
  """The checks reject exactly the invalid side of each boundary."""
  c = _tiny()
  for key, value in changes.items():
    _set(c, key, value)
  moc_jax.validate(c)


def test_validate_rejects_all_zero_chapter_weights():
  """No shared chapter and routed_scaling_factor 0 make every chapter weight 0/0 (NaN logits)."""
  c = _tiny()
  c.memory.num_shared = 0
  c.memory.routed_scaling_factor = 0.0
  with pytest.raises(moc_jax.ConfigError, match=r"config\.memory\.(routed_scaling_factor|num_shared):"):
    moc_jax.validate(c)


def test_disabled_memory_skips_memory_checks():
  """A vanilla config ignores memory fields, so leftover MoC values cannot break it."""
  c = moc_jax.load_config("configs/vanilla.py:tiny")
  c.memory.top_k = 10_000
  c.memory.placement = "bogus"
  moc_jax.validate(c)


def test_load_config_overrides_and_lock():
  c = moc_jax.load_config("configs/moc.py:tiny", {"memory.top_k": 4, "memory.layer_indices": [0, 2]})
  assert c.memory.top_k == 4
  assert c.memory.layer_indices == (0, 2)  # lists become tuples
  assert c.is_locked
  with pytest.raises(AttributeError):
    c.memory.new_field = 1


@pytest.mark.parametrize("key", ["memory.top_kk", "modle.d_model", "model.d_model.x"])
def test_load_config_unknown_override(key):
  with pytest.raises(moc_jax.ConfigError, match="override"):
    moc_jax.load_config("configs/moc.py:tiny", {key: 1})


def test_load_config_override_is_validated():
  with pytest.raises(moc_jax.ConfigError, match=r"config\.memory\.top_k:"):
    moc_jax.load_config("configs/moc.py:tiny", {"memory.top_k": 65})


def test_bad_config_arg_message():
  """A typo in the config name lists the valid names (ConfigError is a ValueError)."""
  with pytest.raises(ValueError) as err:
    moc_jax.load_config("configs/moc.py:nope")
  msg = str(err.value)
  assert "'nope'" in msg and "262k" in msg and "tiny" in msg
  with pytest.raises(ValueError, match="unknown modifiers"):
    moc_jax.load_config("configs/moc.py:tiny,fast")
  with pytest.raises(moc_jax.ConfigError, match="not found"):
    moc_jax.load_config("configs/nope.py:tiny")


@pytest.mark.parametrize("spec,layers,enabled", [
    ("configs/moc.py:tiny", 4, True),
    ("configs/moc.py:small", 8, True),
    ("configs/moc.py:262k", 16, True),
    ("configs/moc.py:262k,runlocal", 16, True),
    ("configs/vanilla.py:tiny", 4, False),
    ("configs/vanilla.py:backbone", 16, False),
    ("configs/vanilla.py:iso", 24, False),
])
def test_shipped_configs_validate(spec, layers, enabled):
  c = moc_jax.load_config(spec)
  moc_jax.validate(c)
  assert c.model.num_layers == layers
  assert c.memory.enabled == enabled
  assert bool(memory_layers(c)) == enabled
  if "runlocal" in spec:
    assert c.model.max_seq_len == 64


def test_tiny_and_small_route_causally_the_paper_config_and_imports_as_mocpt():
  """`tiny` and `small` default to the `routed` balance and causal `prefix` routing; base_config, the paper config
  and an imported MoC-PT config keep MoC-PT's `mocpt` + `sequence` (parity with MoC-PT rests on them)."""
  for name in ("tiny", "small"):
    c = moc_jax.load_config(f"configs/moc.py:{name}")
    assert (c.memory.load_balance, c.memory.routing, c.memory.routing_pool) == ("routed", "prefix", "mean"), name
    assert routing_is_causal(c)
  for c in (base_config(), moc_jax.load_config("configs/moc.py:262k"), moc_jax.load_config("configs/mocpt.py")):
    assert (c.memory.load_balance, c.memory.routing, c.memory.routing_pool) == ("mocpt", "sequence", "mean")
    assert not routing_is_causal(c)


def _paper(**fields):
  """The 262k config (16 layers) with memory fields replaced, unvalidated."""
  c = moc_jax.load_config("configs/moc.py:262k")
  for k, v in fields.items():
    c.memory[k] = v
  return c


@pytest.mark.parametrize("fields,expected", [
    ({"placement": "all"}, tuple(range(16))),
    ({"placement": "first_k", "placement_k": 5}, (0, 1, 2, 3, 4)),
    ({"placement": "last_k", "placement_k": 5}, (11, 12, 13, 14, 15)),
    ({"placement": "every_n", "placement_n": 3}, (0, 3, 6, 9, 12, 15)),
    ({"placement": "every_n", "placement_n": 16}, (0,)),
    ({"placement": "custom"}, (2, 6, 10, 14)),
    ({"placement": "custom", "layer_indices": (14, 2, 7)}, (2, 7, 14)),
    ({"placement": "none"}, ()),
    ({"enabled": False}, ()),
])
def test_memory_layers(fields, expected):
  assert memory_layers(_paper(**fields)) == expected


@pytest.mark.parametrize("fields,expected", [
    ({"sharing": "shared"}, (0, 0, 0, 0)),
    ({"sharing": "per_layer"}, (0, 1, 2, 3)),
    ({"sharing": "every_k_layers", "sharing_k": 2}, (0, 0, 1, 1)),
    ({"sharing": "every_k_layers", "sharing_k": 3}, (0, 0, 0, 1)),
])
def test_bank_ids(fields, expected):
  assert bank_ids(_paper(**fields)) == expected


def test_layer_plan():
  """Periodic placements scan over groups; anything else is one unrolled group of every layer."""
  assert layer_plan(_paper()) == LayerPlan(period=4, num_groups=4, memory_offsets=(2,), scanned=True)
  assert layer_plan(_paper(layer_indices=(2, 6, 11, 14))) == LayerPlan(16, 1, (2, 6, 11, 14), False)
  assert layer_plan(_paper(placement="all")) == LayerPlan(1, 16, (0,), True)
  assert layer_plan(_paper(placement="first_k", placement_k=5)) == LayerPlan(16, 1, (0, 1, 2, 3, 4), False)
  assert layer_plan(_paper(sharing="every_k_layers", sharing_k=2)) == LayerPlan(16, 1, (2, 6, 10, 14), False)
  assert layer_plan(_paper(enabled=False)) == LayerPlan(1, 16, (), True)
  c = _paper()
  c.model.scan_layers = False
  assert layer_plan(c) == LayerPlan(16, 1, (2, 6, 10, 14), False)
  assert layer_plan(_tiny()) == LayerPlan(2, 2, (1,), True)


def _command(module, *args):
  """`python -m module args` from the repository root -> (exit code, stderr)."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=root,
                        env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}, timeout=300)
  return proc.returncode, proc.stderr


@pytest.mark.parametrize("module, args", [
    ("moc_jax.main", ["--config=configs/moc.py:tiny", "--workdir=/nonexistent"]),
    ("moc_jax.eval", ["--workdir=/nonexistent"])])  # its --config is a dict parsed when the flag is defined
def test_an_override_naming_no_field_is_one_error_line(module, args):
  code, stderr = _command(module, *args, "--config.memory.top_kk=2")
  assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
  assert "error: a --config override names no config field (top_kk Did you mean top_k" in stderr
  assert "--config.memory.top_kk" in stderr


@pytest.mark.parametrize("args, message", [
    (["--config=configs/nonexistent.py:tiny", "--workdir=/nonexistent"],
     "error: config file 'configs/nonexistent.py' not found"),
    (["--config=configs/moc.py:huge", "--workdir=/nonexistent"], "the first item must be one of ['262k', 'small', 'tiny']"),
    (["--config=configs/moc.py:tiny"], "error: --config=PATH.py:ARG and --workdir=DIR are both required")])
def test_a_bad_command_line_is_one_error_line(args, message):
  """No traceback, no help dump: one line naming the fix, exit code 2, and no workdir created."""
  code, stderr = _command("moc_jax.main", *args)
  assert code == 2 and "Traceback" not in stderr and message in stderr, stderr[-2000:]
  assert len([line for line in stderr.splitlines() if line.startswith("error:")]) == 1, stderr[-2000:]
