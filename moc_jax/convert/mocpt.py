"""MoC-PT (the authors' PyTorch code) -> moc_jax: state_dict tensors (their configs: convert/mocpt_config.py).

`param_map` lists, for every MoC-PT tensor, where it
lives in our parameter tree and how its layout differs; loading and gradient comparison both use it.

`python -m moc_jax.convert.mocpt --state_dict model.pt --config their.yaml --out DIR [--step 0]` turns a
MoC-PT checkpoint into a moc_jax workdir (DIR/config.json, DIR/checkpoints/) that the evaluations
(`python -m moc_jax.eval --workdir=DIR`, `--mode=eval`) and `--config.train.init_from=DIR` accept.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import sys

import ml_dtypes
import numpy as np
from absl import flags
from flax import nnx, traverse_util

from moc_jax import cli
from moc_jax.config import bank_ids, layer_plan, memory_layers
from moc_jax.convert.mocpt_config import load_mocpt_config
from moc_jax.data.tokenizers import get_tokenizer, model_tokenizer
from moc_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Entry:
  """One MoC-PT tensor: our parameter path, its slot on a stacked axis (or None), and its layout kind."""
  path: tuple
  index: int | None
  kind: str  # "same" | "linear" (torch [out,in] -> ours [in,out]) | "bank" ([N,d] -> [C,T,d] at bank id)

  def to_ours(self, t, leaf_shape):
    if self.kind == "linear":
      return t.T
    if self.kind == "bank":
      return t.reshape(leaf_shape[1:])
    return t

  def mocpt_shape(self, leaf_shape) -> tuple:
    """The MoC-PT tensor's shape for our leaf of `leaf_shape`."""
    shape = tuple(leaf_shape if self.index is None else leaf_shape[1:])
    if self.kind == "linear":
      return shape[::-1]
    if self.kind == "bank":
      return (math.prod(shape[:-1]), shape[-1])
    return shape

  def from_ours(self, a):
    a = a if self.index is None else a[self.index]
    if self.kind == "linear":
      return a.T
    if self.kind == "bank":
      return a.reshape(-1, a.shape[-1])
    return a


def param_map(config) -> dict[str, Entry]:
  """{MoC-PT state_dict key: Entry} for every parameter of the equivalent model (buffers excluded)."""
  if config.memory.enabled and config.memory.router != "linear":
    raise ConfigError(f"config.memory.router: {config.memory.router!r} has no MoC-PT counterpart (MoC-PT's router "
                      "is one linear map over every chapter) — use memory.router='linear'")
  plan = layer_plan(config)
  entries = {"embed_tokens.weight": Entry(("embed", "embedding"), None, "same"),
             "norm.weight": Entry(("final_norm", "scale"), None, "same")}
  mem_layers = memory_layers(config)
  mlp = ("gate", "up", "down") if config.model.hidden_activation == "swiglu" else ("up", "down")  # plain: no gate
  for b in sorted(set(bank_ids(config))):
    entries[f"memory_banks.{b}.base_bank.memory"] = Entry(("bank", "memory"), b, "bank")
  for i in range(config.model.num_layers):
    j, index = plan.slot(i)
    blk = ("layers", "blocks", j)

    def add(key, sub, kind):
      entries[key] = Entry(blk + sub, index, kind)

    add(f"layers.{i}.input_layernorm.weight", ("attn_norm", "scale"), "same")
    add(f"layers.{i}.post_attention_layernorm.weight", ("mlp_norm", "scale"), "same")
    for n in "qkvo":
      add(f"layers.{i}.self_attn.{n}_proj.weight", ("attn", n, "kernel"), "linear")
    for n in mlp:
      add(f"layers.{i}.mlp.{n}_proj.weight", ("mlp", n, "kernel"), "linear")
    if i in mem_layers:
      add(f"layers.{i}.memory_layernorm.weight", ("memory", "norm", "scale"), "same")
      for n in "qkvo":
        add(f"layers.{i}.memory_attn.{n}_proj.weight", ("memory", "attn", n, "kernel"), "linear")
      add(f"routers.{i}.router.weight", ("memory", "router", "proj", "kernel"), "linear")
      add(f"routers.{i}.router.bias", ("memory", "router", "proj", "bias"), "same")
      if config.memory.block_variant == "B":
        add(f"layers.{i}.post_memory_layernorm.weight", ("post_memory_norm", "scale"), "same")
        for n in mlp:
          add(f"layers.{i}.post_memory_mlp.{n}_proj.weight", ("post_memory_mlp", n, "kernel"), "linear")
  return entries


def _check_buffers(config, state_dict):
  """RoPE inv_freq buffers and the tied head must agree with what our model computes / ties."""
  if "lm_head.weight" in state_dict and not np.array_equal(state_dict["lm_head.weight"],
                                                           state_dict["embed_tokens.weight"]):
    raise ConfigError("MoC-PT lm_head.weight differs from embed_tokens.weight: only tied heads are supported")
  d = config.model.d_model // config.model.num_heads
  expected = 1.0 / config.model.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  for key, value in state_dict.items():  # to the precision it was saved in (MoC-PT's save_precision)
    if key.endswith("rotary.inv_freq") and not np.allclose(
        np.asarray(value, np.float64), expected, rtol=max(1e-6, 2 * float(ml_dtypes.finfo(value.dtype).eps))):
      raise ConfigError(f"MoC-PT {key} does not match rope_theta={config.model.rope_theta}")


def _listing(what, names, limit=8):
  return f"{what} {len(names)}: {', '.join(names[:limit])}{', ...' if len(names) > limit else ''}"


def mocpt_params(config, state_dict, shapes) -> dict:
  """MoC-PT state_dict (numpy arrays, their key names) -> our parameter pure dict, float32 numpy.

  `shapes` maps each of our parameter paths to its shape in the user view (the bank holds exactly
  num_chapters chapters). ConfigError lists the missing, unexpected and mis-shaped tensors; the tied
  `lm_head.weight` and the RoPE `inv_freq` buffers are checked, not loaded.
  """
  entries = param_map(config)
  unmapped = sorted("/".join(map(str, p)) for p in set(shapes) - {e.path for e in entries.values()})
  if unmapped:
    raise NotImplementedError(f"no MoC-PT tensor maps to our parameters {unmapped}")
  missing = sorted(set(entries) - set(state_dict))
  extra = sorted(k for k in state_dict if k not in entries and not k.endswith("rotary.inv_freq")
                 and k != "lm_head.weight")
  misshaped = [f"{k} {tuple(np.shape(state_dict[k]))} (expected {e.mocpt_shape(shapes[e.path])})"
               for k, e in entries.items() if k in state_dict
               and tuple(np.shape(state_dict[k])) != e.mocpt_shape(shapes[e.path])]
  if missing or extra or misshaped:
    problems = [_listing(w, n) for w, n in (("missing", missing), ("unexpected", extra),
                                            ("mis-shaped", misshaped)) if n]
    raise ConfigError("MoC-PT state_dict does not match the config: " + "; ".join(problems))
  _check_buffers(config, state_dict)
  arrays = {path: np.zeros(shape, np.float32) for path, shape in shapes.items()}
  for key, e in entries.items():
    arr = arrays[e.path]
    value = e.to_ours(np.asarray(state_dict[key], np.float32), arr.shape)
    if e.index is None:
      arr[...] = value
    else:
      arr[e.index] = value
  return traverse_util.unflatten_dict(arrays)


def user_view_shapes(config, params) -> dict[tuple, tuple]:
  """{path: shape} of a parameter pure dict (arrays or ShapeDtypeStructs), the bank's chapter axis
  cut to num_chapters (as checkpoints hold it, whatever padding the mesh needs)."""
  shapes = {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(params).items()}
  if ("bank", "memory") in shapes:
    b, _, *rest = shapes[("bank", "memory")]
    shapes[("bank", "memory")] = (b, config.memory.num_chapters, *rest)
  return shapes


def load_mocpt_state(model, state_dict) -> None:
  """Copies a MoC-PT state_dict (numpy arrays, their key names) into `model` in place; padded chapters
  of the bank, if any, are zero."""
  config = model.cfg
  state = nnx.state(model, nnx.Param)
  pure = state.to_pure_dict()
  loaded = mocpt_params(config, state_dict, user_view_shapes(config, pure))
  if "bank" in loaded:
    bank = loaded["bank"]["memory"]
    extra = pure["bank"]["memory"].shape[1] - bank.shape[1]
    loaded["bank"]["memory"] = np.pad(bank, [(0, 0), (0, extra), (0, 0), (0, 0)])
  nnx.replace_by_pure_dict(state, loaded)
  nnx.update(model, state)


def to_mocpt(config, tree) -> dict[str, np.ndarray]:
  """Our parameter-shaped pure dict (params or gradients) -> {MoC-PT key: array in their layout}."""
  return {key: np.asarray(e.from_ours(np.asarray(_get(tree, e.path)))) for key, e in param_map(config).items()}


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


# --- `python -m moc_jax.convert.mocpt`: a MoC-PT checkpoint as a moc_jax workdir -----------------------

_WRAPPERS = ("model", "state_dict", "model_state_dict")  # torch.save'd dicts that hold a state_dict


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """MoC-PT tensors by state_dict name: `.npz` (names optionally under `param/`, as in the parity
  fixtures), `.safetensors` (safetensors package) or `.pt` / `.bin` (torch)."""
  if not os.path.isfile(path):
    raise ConfigError(f"--state_dict {path}: no such file")
  ext = os.path.splitext(path)[1].lower()
  if ext == ".npz":
    with np.load(path) as f:
      names = [k for k in f.files if k.startswith("param/")] or f.files
      return {k.removeprefix("param/"): f[k] for k in names}
  if ext == ".safetensors":
    try:
      from safetensors.numpy import load_file
    except ImportError:
      raise ConfigError(f"reading {path} needs the safetensors package: pip install safetensors") from None
    return load_file(path)
  if ext in (".pt", ".bin"):
    return _read_torch(path)
  raise ConfigError(f"--state_dict {path}: unknown format {ext!r}; use .npz, .safetensors or .pt")


def _read_torch(path):
  """A torch.save'd state_dict, or a dict holding one under `model`, `state_dict` or `model_state_dict`
  (MoC-PT's trainer writes the bare state_dict as model.pt), as numpy arrays of the saved dtypes."""
  try:
    import torch
  except ImportError:
    raise ConfigError(f"reading {path} needs PyTorch: pip install torch (the CPU build suffices)") from None
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    raise ConfigError(f"{path}: torch.load(weights_only=True) refused it: {e}") from None
  if isinstance(obj, dict):
    obj = next((obj[k] for k in _WRAPPERS if isinstance(obj.get(k), dict)), obj)
  if not isinstance(obj, dict) or not obj or not all(torch.is_tensor(v) for v in obj.values()):
    raise ConfigError(f"{path} holds no state_dict: expected a dict of tensors, bare or under one of {_WRAPPERS}")
  return {k: v.detach().float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16
          else v.detach().numpy() for k, v in obj.items()}


def import_checkpoint(state_dict, config, out: str, step: int = 0) -> str:
  """Writes `out`/config.json and the Orbax item `params` at `step` under `out`/checkpoints/, as
  training writes them (the user view: exactly num_chapters chapters). The train-only items are absent:
  the workdir serves evaluation and `--config.train.init_from`, not resumption. Returns the step's path."""
  import jax
  import jax.numpy as jnp

  import moc_jax
  from moc_jax.checkpoint import write_weights

  directory = os.path.join(os.path.abspath(out), "checkpoints")
  if os.path.isdir(directory) and os.listdir(directory):
    raise ConfigError(f"--out {out} already holds checkpoints; import into a new directory")
  params = nnx.state(moc_jax.abstract_model(config), nnx.Param)
  abstract = params.to_pure_dict()
  loaded = mocpt_params(config, state_dict, user_view_shapes(config, abstract))
  nnx.replace_by_pure_dict(params, jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), loaded, abstract))
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  return write_weights(directory, step, params)


_FLAGS = cli.command_flags(__doc__)
flags.DEFINE_string("state_dict", None, "MoC-PT weights: model.pt / .bin (needs torch), .safetensors, or .npz of "
                    "their tensors", required=True, flag_values=_FLAGS)
flags.DEFINE_string("config", None, "the run's MoC-PT YAML (e.g. its checkpoint's config.yaml) or a JSON with "
                    "model/memory", required=True, flag_values=_FLAGS)
flags.DEFINE_string("out", None, "the workdir to create", required=True, flag_values=_FLAGS)
flags.DEFINE_integer("step", 0, "checkpoint step number", lower_bound=0, flag_values=_FLAGS)
flags.DEFINE_string("tokenizer", None, "the tokenizer the MoC-PT model was trained with (hf:<tokenizer.json> | "
                    "sp:<model.model>), written into config.json for evaluation (default: data.tokenizer's, byte)",
                    flag_values=_FLAGS)


def with_tokenizer(config, spec):
  """`config` evaluating with tokenizer `spec`, whose ids must fit the imported vocabulary
  (data.tokenizers.model_tokenizer refuses it otherwise). Without `spec` the config's default (byte) stays, with
  one warning if its id count differs from the model's: evaluations would feed the model another tokenizer's
  ids (or ids past its embedding, which they refuse)."""
  if spec is not None:
    config.data.tokenizer = spec
    model_tokenizer(config)
    return config
  ids = get_tokenizer(config.data.tokenizer).vocab_size
  if ids != config.model.vocab_size:
    logging.getLogger("moc_jax").warning(
        "MoC-PT model.vocab_size=%d but data.tokenizer=%r has %d ids: pass --tokenizer=hf:<the tokenizer.json the "
        "model was trained with> (its model.tokenizer_name), or evaluations read another tokenizer's ids",
        config.model.vocab_size, config.data.tokenizer, ids)
  return config


@cli.exit_on_error
def main(argv=None) -> int:
  args = cli.parse_command(_FLAGS, argv)
  config = with_tokenizer(load_mocpt_config(args.config), args.tokenizer)
  path = import_checkpoint(read_state_dict(args.state_dict), config, args.out, args.step)
  spec = f"configs/mocpt.py:{args.config}"
  print(f"wrote {os.path.join(args.out, 'config.json')} and {path}\n"
        f"evaluate: python -m moc_jax.eval --workdir={args.out}  (or python -m moc_jax.main --config={spec},import "
        f"--workdir={args.out} --mode=eval)\n"
        f"train from it: python -m moc_jax.main --config={spec} --workdir=NEW_DIR "
        f"--config.train.init_from={args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
