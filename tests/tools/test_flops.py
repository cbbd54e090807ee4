"""The FLOPs estimator against MoC-PT's published counts (docs/mocpt_semantics.md#published-flops-and-parameter-counts) and hand counts.

Hand counts are written from MoC-PT's counting rules (docs/mocpt_semantics.md#flops-counting-rules), independently of moc_jax/flops.py. Exact integers throughout.
"""
import json
import os
import subprocess
import sys

import pytest

import moc_jax
from moc_jax import flops

PAPER_YAML = "configs/mocpt.py:configs/mocpt_examples/base_small_run2.yaml"
SMALL_YAML = "configs/mocpt.py:configs/mocpt_examples/base_small.yaml"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _paper(**overrides):
  return moc_jax.load_config("configs/moc.py:262k", overrides)


@pytest.fixture(scope="module")
def paper():
  return flops.estimate(_paper())


def test_standard_layer_paper(paper):
  """MoC-PT's published 'Standard layer' table, B = 1, L = 1024."""
  s = paper["standard_layer"]
  assert s["self_attention"] == {"total": 6_530_531_328, "q": 1_207_959_552, "k": 402_653_184, "v": 402_653_184,
                                 "o": 1_207_959_552, "scores": 3_221_225_472, "softmax": 88_080_384}
  assert s["rope"] == 3_145_728
  assert s["norms"]["total"] == 6_299_648
  assert s["mlp"] == {"total": 10_883_432_448, "gate": 3_623_878_656, "up": 3_623_878_656,
                      "down": 3_623_878_656, "activation": 11_796_480}
  assert s["residuals"]["total"] == 1_572_864
  assert s["total"] == 17_424_982_016


def test_memory_layer_paper(paper):
  """MoC-PT's published 'MoC extra per memory layer' with every sub-part, the memory layer and the head."""
  m = paper["memory_layer"]["memory"]
  assert m["router"] == {"total": 7_124_491, "pool": 786_432, "linear": 6_292_992, "softmax": 20_485,
                         "top_k": 24_582}
  assert m["router_aux"] == {"total": 331_859, "f": 262_208, "P": 4_097, "load_balance": 8_194,
                             "p_squared": 8_194, "mse": 12_291, "z": 20_485 + 2, "entropy": 16_388}
  assert m["preprocessing"] == {"total": 15_991_040, "weighting": 3_194_880, "token_norm": 12_796_160}
  # the published table prints QKᵀ+AV as 13,086,351,360, which does not add up to its own total 25,674,645,504;
  # 4·1024·4160·768 = 13,086,228,480 does.
  assert m["attention"] == {"total": 25_674_645_504, "q": 1_207_959_552, "k": 4_907_335_680, "v": 4_907_335_680,
                            "o": 1_207_959_552, "scores": 4 * 1024 * 4160 * 768, "softmax": 357_826_560}
  assert (m["norm"], m["residual"]) == (3_149_824, 786_432)
  assert m["total"] == 25_702_029_150
  assert paper["memory_layer"]["backbone"] == paper["standard_layer"]
  assert paper["memory_layer"]["total"] == 43_127_011_166
  assert paper["head"] == {"total": 77_563_973_632, "final_norm": 3_149_824, "lm_head": 77_309_411_328,
                           "cross_entropy": 251_412_480}


@pytest.mark.parametrize("spec,forward,matmul,elementwise,train", [
    ("configs/moc.py:262k", 459_171_802_488, 455_627_249_664, 3_544_552_824, 1_759_123_236_320),
    ("configs/vanilla.py:iso", 495_763_542_016, 492_847_497_216, 2_916_044_800, 1_905_490_194_432),
    ("configs/vanilla.py:backbone", 356_363_685_888, 354_334_801_920, 2_028_883_968, 1_347_890_769_920),
    (PAPER_YAML, 459_171_802_488, 455_627_249_664, 3_544_552_824, 1_759_123_236_320),
])
def test_model_totals_paper(spec, forward, matmul, elementwise, train):
  """MoC-PT's published 'Model totals': forward, its matmul / element-wise split, training incl. layer recompute."""
  e = flops.estimate(moc_jax.load_config(spec))
  assert (e["batch"], e["seq_len"]) == (1, 1024)
  assert e["forward"]["total"] == forward
  assert (e["forward"]["matmul"], e["forward"]["elementwise"]) == (matmul, elementwise)
  assert e["backward"] == 2 * forward
  assert e["recompute"]["layers"] == forward - 77_563_973_632  # every layer's forward, head excluded
  assert e["train"]["micro_step"] == train


def test_param_counts_paper():
  """The published parameter counts: every figure, from count_params on the shipped configs and the MoC-PT paper YAML."""
  moc = moc_jax.count_params(moc_jax.load_config("configs/moc.py:262k"))
  assert moc == {"total": 371_292_932, "backbone": 147_874_560, "bank": 201_375_744, "memory_layers": 22_042_628}
  assert moc_jax.count_params(moc_jax.load_config(PAPER_YAML)) == moc
  iso = moc_jax.count_params(moc_jax.load_config("configs/vanilla.py:iso"))["total"]
  backbone = moc_jax.count_params(moc_jax.load_config("configs/vanilla.py:backbone"))["total"]
  assert (iso, backbone) == (202_937_088, 147_874_560)
  per_layer = (iso - backbone) // 8
  assert per_layer == 1_572_864 + 5_308_416 + 1_536 == 6_882_816
  assert backbone - 16 * per_layer - 768 == 37_748_736  # tied embedding
  assert moc["memory_layers"] // 4 == 2_359_296 + 768 + 3_150_593 == 5_510_657


def test_tiny_standard_layer_by_hand():
  """configs/moc.py:tiny (d 64, 4/2 heads, SwiGLU 192, vocab 260), one 128-token sequence."""
  e = flops.estimate(moc_jax.load_config("configs/moc.py:tiny"), 1, 128)
  t, d, kv, f = 128, 64, 32, 192
  attention = 2 * (2 * t * d * d) + 2 * (2 * t * d * kv) + 4 * t * t * d + (5 + 2) * 4 * t * t
  layer = attention + 3 * t * (d + kv) + 2 * t * (4 * d + 4) + 3 * (2 * t * d * f) + 5 * t * f + 2 * t * d
  assert e["standard_layer"]["total"] == layer == 17_478_656
  assert e["head"]["total"] == t * (4 * d + 4) + 2 * t * d * 260 + 5 * (t - 1) * 260


@pytest.mark.parametrize("activation, per_element", [("gelu", 8), ("relu", 1), ("silu", 4), ("sigmoid", 4),
                                                     ("tanh", 4)])
def test_tiny_standard_layer_with_a_plain_mlp_by_hand(activation, per_element):
  """model.hidden_activation: no gate projection, the activation at MoC-PT's cost per hidden element (its
  scripts/estimate_flops.py ACTIVATION_FLOPS); the same layer as above otherwise. Its parameters lose the gates."""
  config = moc_jax.load_config("configs/moc.py:tiny", {"model.hidden_activation": activation})
  e = flops.estimate(config, 1, 128)
  t, d, kv, f = 128, 64, 32, 192
  attention = 2 * (2 * t * d * d) + 2 * (2 * t * d * kv) + 4 * t * t * d + (5 + 2) * 4 * t * t
  layer = attention + 3 * t * (d + kv) + 2 * t * (4 * d + 4) + 2 * (2 * t * d * f) + per_element * t * f + 2 * t * d
  assert e["standard_layer"]["total"] == layer
  gated = moc_jax.count_params(moc_jax.load_config("configs/moc.py:tiny"))["backbone"]
  assert moc_jax.count_params(config)["backbone"] == gated - config.model.num_layers * d * f


def test_linear_in_batch():
  """Every count is linear in the batch except the LB and MSE aux terms (reductions over chapters only)."""
  c = _paper()
  one, four = flops.estimate(c, 1), flops.estimate(c, 4)

  def leaves(tree, path=()):
    for k, v in tree.items():
      if isinstance(v, dict):
        yield from leaves(v, path + (k,))
      elif k != "total":
        yield path + (k,), v

  for section in ("standard_layer", "memory_layer", "head"):
    for (path, a), (_, b) in zip(leaves(one[section]), leaves(four[section])):
      assert b == (a if path[-1] in ("load_balance", "mse") else 4 * a), path
  assert four["forward"]["total"] == 4 * one["forward"]["total"] - 3 * 4 * (8_194 + 12_291)
  iso = moc_jax.load_config("configs/vanilla.py:iso")
  assert flops.estimate(iso, 5)["train"]["micro_step"] == 5 * 1_905_490_194_432


T, D, SEL = 1024, 768, 4160  # paper: tokens, width, memory tokens read per sequence


@pytest.mark.parametrize("overrides,delta", [
    # variant B: a second norm, SwiGLU MLP and residual
    ({"memory.block_variant": "B"}, T * (4 * D + 4) + 3 * 2 * T * D * 2304 + 5 * T * 2304 + T * D),
    # GQA over memory: K and V project to 4·64 = 256 instead of 768
    ({"memory.num_kv_heads": 4}, -2 * 2 * SEL * D * (768 - 256)),
    # no shared chapter: 64 fewer tokens read, and no token norm (MoC-PT skips it without shared chapters)
    ({"memory.num_shared": 0}, -(64 * D + SEL * (4 * D + 4) + 2 * 2 * 64 * D * D + 4 * T * 64 * D + 7 * 12 * T * 64)),
    # 512-d bank: weighting, token norm and K/V inputs shrink
    ({"memory.dim": 512}, -(SEL * 256 + SEL * 4 * 256 + 2 * 2 * SEL * 256 * D)),
    ({"memory.token_norm": "layernorm"}, SEL * (4 * D + 4)),
    ({"memory.token_norm": "none"}, -SEL * (4 * D + 4)),
    # banks never change FLOPs
    ({"memory.sharing": "per_layer"}, 0),
    ({"memory.sharing": "every_k_layers"}, 0),
])
def test_memory_variants(paper, overrides, delta):
  e = flops.estimate(_paper(**overrides))
  assert e["memory_layer"]["total"] - paper["memory_layer"]["total"] == delta
  assert e["forward"]["total"] - paper["forward"]["total"] == 4 * delta
  assert e["standard_layer"] == paper["standard_layer"]


def test_placement_and_banks():
  e = flops.estimate(_paper(**{"memory.placement": "all", "memory.sharing": "per_layer"}))
  assert e["layers"] == {"standard": 0, "memory": list(range(16)), "banks": 16}
  assert e["forward"]["total"] == 16 * 43_127_011_166 + 77_563_973_632


def test_recompute_flash_and_totals(paper):
  c = _paper()
  no_remat = flops.estimate(c, recompute=False)
  assert no_remat["train"]["micro_step"] == 3 * 459_171_802_488
  pre_wo = 25_674_645_504 - 1_207_959_552  # memory attention up to W_o
  no_flash = flops.estimate(c, flash=False)
  assert no_flash["recompute"] == {"total": paper["recompute"]["total"] + 4 * pre_wo,
                                   "layers": paper["recompute"]["layers"], "memory_attention": 4 * pre_wo}
  iso = moc_jax.load_config("configs/vanilla.py:iso")
  assert flops.estimate(iso, flash=False) == flops.estimate(iso)  # no memory attention to recompute
  t = flops.estimate(c, 2, world_size=8, accum=4, steps=10)["train"]
  assert t["step"] == 32 * t["micro_step"] and t["run"] == 10 * t["step"]
  assert paper["train"]["steps"] == 9600 and paper["train"]["accum"] == 4  # defaults from train.*
  assert flops.model_flops_per_token(c) == 3 * 459_171_802_488 / 1024


def test_mocpt_paper_yaml_is_the_262k_config():
  p, ref = moc_jax.load_config(PAPER_YAML), moc_jax.load_config("configs/moc.py:262k")
  assert p.model.to_dict() == ref.model.to_dict() and p.memory.to_dict() == ref.memory.to_dict()
  assert (p.data.seq_len, p.data.layout) == (1024, "pad_truncate")
  t = p.train
  assert (t.base_lr, t.memory_lr, t.bank_lr) == (3e-4, 6e-4, 6e-4)
  assert (t.batch_size, t.grad_accum, t.steps) == (32 * 8, 4, 9600)
  assert (t.schedule, t.warmup_steps, t.decay_start_step, t.min_lr_ratio) == ("wsd", 250, 8160, 0.1)
  assert (t.weight_decay, t.b1, t.b2, t.eps, t.clip_norm) == (0.1, 0.9, 0.95, 1e-8, 1.0)


def test_mocpt_base_small_yaml():
  """Column S: 512-d, 30 layers all with memory, 8/4 heads, SwiGLU 1536, 514 chapters (2 shared) x 32 tokens,
  top-8, memory heads 8/4; MoC-PT's defaults elsewhere (lr 1e-5, cosine)."""
  c = moc_jax.load_config(SMALL_YAML)
  assert (c.memory.routed_scaling_factor, c.memory.token_norm_eps, c.train.schedule) == (5.0, 1e-6, "cosine")
  d, kv, f, v = 512, 256, 1536, 49_152
  layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
  memory_layer = 2 * d * d + 2 * d * kv + d + (d * 514 + 514)
  assert moc_jax.count_params(c) == {"total": v * d + 30 * layer + d + 30 * memory_layer + 16_448 * d,
                                     "backbone": v * d + 30 * layer + d, "bank": 16_448 * d,
                                     "memory_layers": 30 * memory_layer}
  assert moc_jax.count_params(c)["total"] == 159_509_052

  e = flops.estimate(c)  # one 2048-token sequence
  t, sel, chapters = 2048, 320, 514
  standard = (2 * (2 * t * d * d) + 2 * (2 * t * d * kv) + 4 * t * t * d + 7 * 8 * t * t + 3 * t * (d + kv)
              + 2 * t * (4 * d + 4) + 3 * (2 * t * d * f) + 5 * t * f + 2 * t * d)
  router = d * (t - 1) + d + 2 * d * chapters + 5 * chapters + chapters * 3  # ceil(log2 8) = 3
  aux = (chapters * 7 + chapters) + chapters + 2 * chapters + 2 * chapters + 3 * chapters + (5 * chapters + 2) \
      + 4 * chapters
  memory = (router + aux + sel * d + sel * (4 * d + 4)
            + 2 * (2 * t * d * d) + 2 * (2 * sel * d * kv) + 4 * t * sel * d + 7 * 8 * t * sel
            + t * (4 * d + 4) + t * d)
  head = t * (4 * d + 4) + 2 * t * d * v + 5 * (t - 1) * v
  assert e["memory_layer"]["memory"]["total"] == memory
  assert e["forward"]["total"] == 30 * (standard + memory) + head


def test_mocpt_yaml_errors(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("model:\n  hidden_dims: 512\n")
  with pytest.raises(moc_jax.ConfigError, match="hidden_dims"):
    moc_jax.load_config(f"configs/mocpt.py:{bad}")
  bad.write_text("model:\n  chat_template: null\nmemory:\n  use_chapters: true\n  num_memory_tokens: 1000\n"
                 "training:\n  num_epochs: 2\n  max_steps: 700\n")
  with pytest.raises(moc_jax.ConfigError, match="num_epochs"):
    moc_jax.load_config(f"configs/mocpt.py:{bad}")
  # a checkpoint's config.yaml (as MoC-PT saved them: chat_template, epochs) imports; its length is max_steps
  assert moc_jax.load_config(f"configs/mocpt.py:{bad},import").train.steps == 700


def test_iso_flop_picker(capsys):
  c = moc_jax.load_config("configs/vanilla.py:iso=262k")
  assert (c.model.num_layers, c.memory.enabled) == (22, False)
  assert "22 layers, training FLOPs +0.40%" in capsys.readouterr().out
  assert flops.estimate(c)["train"]["micro_step"] == 22 * 4 * 17_424_982_016 + 3 * 77_563_973_632
  assert moc_jax.load_config("configs/vanilla.py:iso").model.num_layers == 24  # the paper's choice, kept


def test_cli_json_with_override():
  out = subprocess.run(
      [sys.executable, "-m", "moc_jax.flops", "--config=configs/moc.py:262k", "--batch=1", "--json",
       "--config.memory.block_variant=B"],
      cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      check=True).stdout
  e = json.loads(out)
  extra_mlp = T * (4 * D + 4) + 3 * 2 * T * D * 2304 + 5 * T * 2304 + T * D
  assert e["forward"]["total"] == 459_171_802_488 + 4 * extra_mlp


@pytest.mark.parametrize("routing", ["token", "prefix", "chunk"])
def test_per_position_routing_counts_the_bank_projection_once_per_call(routing):
  """Hand counts on the tiny model (d 64, 65 chapters x 16 tokens, 4 heads, 1 shared + top-8)."""
  c = moc_jax.load_config("configs/moc.py:tiny", {"memory.routing": routing, "memory.routing_chunk": 32})
  b, l, d, bank, chapters = 3, 100, 64, 65 * 16, 65
  one, two = (flops.estimate(c, n, l)["memory_layer"]["memory"] for n in (b, 2 * b))
  assert one["attention"]["k"] == one["attention"]["v"] == 2 * bank * d * d == two["attention"]["k"]
  assert one["preprocessing"]["token_norm"] == bank * (4 * d + 4) == two["preprocessing"]["token_norm"]
  assert one["attention"]["scores"] == 4 * b * l * 9 * 16 * d  # every position reads (1 + 8) chapters
  decisions = {"token": b * l, "prefix": b * l, "chunk": b * 4}[routing]  # ceil(100 / 32) = 4 chunks
  assert one["router"]["linear"] == 2 * decisions * d * chapters
  # model FLOPs per token: the bank projection is shared by the micro-batch's rows
  per_row = flops.model_flops_per_token(moc_jax.load_config("configs/moc.py:tiny", {"memory.routing": routing,
                                                                                    "train.batch_size": 1}))
  assert flops.model_flops_per_token(c) < per_row


def test_token_routing_counts_the_shared_chapters_projected_per_row():
  """Token routing reads the shared chapters by an attention of their own, which normalises and projects their
  16 tokens once more for each of the b rows."""
  c = moc_jax.load_config("configs/moc.py:tiny", {"memory.routing": "token"})
  b, d = 3, 64
  m = flops.estimate(c, b, 100)["memory_layer"]["memory"]
  assert m["attention"]["shared_k"] == m["attention"]["shared_v"] == 2 * b * 16 * d * d
  assert m["preprocessing"]["shared_token_norm"] == b * 16 * (4 * d + 4)
  prefix = flops.estimate(moc_jax.load_config("configs/moc.py:tiny"), b, 100)["memory_layer"]["memory"]
  assert "shared_k" not in prefix["attention"]


def _lookup_by_hand(q, half, n, k, value_dim):
  """Product keys of q queries: the search (two halves against n sub-keys each, the top-k of each half's n scores,
  the k^2 candidate sums and their top-k), the k chosen slots' two half scores again, their sums and softmax, and k
  value rows of value_dim read."""
  log_k = (k - 1).bit_length()
  search = {"scores": 2 * (2 * q) * half * n, "top_k": 2 * q * n * log_k + q * k * k * log_k, "candidates": q * k * k}
  return {"query_norm": 0, "search": {"total": sum(search.values()), **search}, "rescore": 2 * (2 * q * k) * half,
          "weights": q * k + 5 * q * k, "values": 2 * q * k * value_dim}


def _total(tree):
  return sum(v["total"] if isinstance(v, dict) else v for v in tree.values())


def test_pkm_memory_layer_by_hand():
  """tiny with memory.kind=pkm: 4 heads of 64-d queries, 64 x 64 slots, top-8, 64-d values, gated output."""
  c = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": "pkm"})
  t, d, heads, dq, n, k, dv = 128, 64, 4, 64, 64, 8, 64
  m = flops.estimate(c, 1, t)["memory_layer"]["memory"]
  lookup = _lookup_by_hand(t * heads, dq // 2, n, k, dv)
  assert {key: v for key, v in m["lookup"].items() if key != "total"} == lookup
  assert m["query"] == 2 * t * d * heads * dq and m["norm"] == t * (4 * d + 4) and m["residual"] == t * d
  assert m["output"] == {"total": 2 * (2 * t * d * dv) + 5 * t * dv, "gate": 2 * t * d * dv, "out": 2 * t * dv * d,
                         "activation": 5 * t * dv}
  assert m["total"] == t * (4 * d + 4) + 2 * t * d * heads * dq + _total(lookup) + m["output"]["total"] + t * d
  ln = flops.estimate(moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": "pkm",
                                                                  "memory.pkm_query_norm": "layernorm"}), 1, t)
  assert ln["memory_layer"]["memory"]["lookup"]["query_norm"] == 2 * t * heads * (8 * dq // 2 + 8)
  assert flops.estimate(c, 1, t)["selected_memory_tokens"] == t * heads * k
  # one sequence; the search (in 2 memory layers) has no backward pass
  search = 2 * _lookup_by_hand(256 * heads, dq // 2, n, k, dv)["search"]["total"]
  assert flops.model_flops_per_token(c) == (3 * flops.estimate(c, 1)["forward"]["total"] - 2 * search) / 256


def test_hml_memory_block_by_hand():
  """tiny with memory.kind=hml: the block's attention without W_o (4/2 heads of 16, RoPE), every head's 16-d
  output against its 64 + 64 sub-keys, top-8 rows of 16, the per-head 16 x 16 maps."""
  c = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": "hml"})
  t, d, heads, dh, kv, n, k = 128, 64, 4, 16, 32, 64, 8
  m = flops.estimate(c, 1, t)["memory_layer"]["memory"]
  attention = 2 * t * d * d + 2 * (2 * t * d * kv) + 4 * t * t * d + 7 * heads * t * t
  assert m["attention"]["total"] == attention and "o" not in m["attention"]
  lookup = _lookup_by_hand(t * heads, dh // 2, n, k, dh)
  assert {key: v for key, v in m["lookup"].items() if key != "total"} == lookup
  assert m["maps"] == 2 * t * heads * dh * dh and m["rope"] == 3 * t * (d + kv)
  assert m["total"] == t * (4 * d + 4) + attention + 3 * t * (d + kv) + _total(lookup) + m["maps"] + t * d


def test_search_runs_forward_only_once():
  """The product-key search has no backward pass and is not recomputed under remat (the remat policies keep its
  result): a train step counts it once, every other FLOP of the layers three times and once more recomputed. A
  chapter read keeps MoC-PT's rule, backward = 2 x forward."""
  for kind in ("pkm", "hml"):
    c = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": kind})
    e = flops.estimate(c, 2, 64)
    search = 2 * e["memory_layer"]["memory"]["lookup"]["search"]["total"]  # two memory layers
    forward, layers = e["forward"]["total"], e["forward"]["layers"]
    assert search > 0 and e["backward"] == 2 * (forward - search), kind
    assert e["recompute"]["layers"] == layers - search, kind
    assert e["train"]["micro_step"] == 3 * forward - 2 * search + layers - search, kind
  chapters = flops.estimate(moc_jax.load_config("configs/moc.py:tiny"), 2, 64)
  assert chapters["backward"] == 2 * chapters["forward"]["total"]
  assert chapters["recompute"]["layers"] == chapters["forward"]["layers"]


def test_iso_flop_width_of_every_kind():
  """The iso-FLOP dense width (configs/moc.py `_iso_mlp_dim`) follows each kind's model FLOPs per token."""
  moc = moc_jax.config.config_module("configs/moc.py")
  for kind in ("chapters", "pkm", "hml"):
    c = moc_jax.load_config("configs/moc.py:tiny", {"memory.kind": kind})
    width = moc._iso_mlp_dim(c, c.memory.top_k)
    dense = moc_jax.load_config("configs/moc.py:tiny", {"memory.enabled": False, "memory.placement": "none",
                                                        "model.mlp_dim": width})
    assert abs(flops.model_flops_per_token(dense) / flops.model_flops_per_token(c) - 1) < 0.02, kind
