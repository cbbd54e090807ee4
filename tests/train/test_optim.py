"""Schedules against MoC-PT's schedule table (docs/mocpt_semantics.md#lr-schedules), parameter-group LRs, AdamW semantics, frozen banks,
the bank update each bank setting decodes to."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import moc_jax
from moc_jax import optim
from moc_jax.config import base_config


def _train_cfg(**kw):
  c = moc_jax.load_config("configs/moc.py:tiny", {"model.compute_dtype": "float32", **kw})
  return c


def test_wsd_matches_reference_table():
  """Paper run: W=250, D=8160, N=9600, r=0.1 (the values MoC-PT's LambdaLR produces)."""
  t = _train_cfg(**{"train.steps": 9600, "train.warmup_steps": 250, "train.decay_start_step": 8160}).train
  lam = optim.schedule_multiplier(t)
  table = {0: 0.0, 1: 0.004, 125: 0.5, 249: 0.996, 250: 1.0, 4000: 1.0, 8160: 1.0, 8520: 0.868198,
           8880: 0.55, 9240: 0.231802, 9599: 0.100001}
  for s, want in table.items():
    assert float(lam(s)) == pytest.approx(want, abs=2e-6), s


def _hand_lambda(kind, s, W, N, D, r):
  """Independent transcription of MoC-PT's λ(s) (utils.py: cosine, linear and WSD all hold the peak from W
  to the decay start D, then decay: cosine to r, linear to 0) in float64."""
  if kind == "constant":
    return 1.0
  if s < W:
    return s / W
  if s < D:
    return 1.0
  if kind == "linear":
    return max(0.0, (N - s) / (N - D))
  return r + (1 - r) * 0.5 * (1 + np.cos(np.pi * (s - D) / (N - D)))


@pytest.mark.parametrize("kind", ["wsd", "cosine", "linear", "constant"])
def test_schedules_against_hand_formula(kind):
  rng = np.random.default_rng(["wsd", "cosine", "linear", "constant"].index(kind))
  N, W = int(rng.integers(200, 2000)), int(rng.integers(1, 100))
  D = int(rng.integers(W, N))
  t = _train_cfg(**{"train.schedule": kind, "train.steps": N, "train.warmup_steps": W,
                    "train.decay_start_step": D, "train.min_lr_ratio": 0.1}).train
  lam = optim.schedule_multiplier(t)
  for s in rng.integers(0, N, 50):
    assert float(lam(int(s))) == pytest.approx(_hand_lambda(kind, int(s), W, N, D, 0.1), abs=1e-5)


@pytest.mark.parametrize("kind, want", [
    ("cosine", [0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 0.868198, 0.55, 0.231802]),
    ("linear", [0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25]),
    ("wsd", [0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 0.868198, 0.55, 0.231802])])
def test_every_decaying_schedule_holds_the_peak_until_the_decay_start(kind, want):
  """W=3, D=8, N=12: MoC-PT's multipliers, written out by hand (cosine and linear honour the decay start
  as WSD does; linear decays to 0 whatever min_lr_ratio)."""
  t = _train_cfg(**{"train.schedule": kind, "train.steps": 12, "train.warmup_steps": 3,
                    "train.decay_start_step": 8, "train.min_lr_ratio": 0.1}).train
  lam = optim.schedule_multiplier(t)
  assert [float(lam(s)) for s in range(12)] == pytest.approx(want, abs=2e-6)


def test_decay_start_ratio_and_defaults():
  t = _train_cfg(**{"train.steps": 1000, "train.warmup_steps": 10, "train.decay_start_ratio": 0.85}).train
  assert optim.decay_start_step(t) == 850
  t = _train_cfg(**{"train.steps": 1000, "train.warmup_steps": 10, "train.decay_start_ratio": None}).train
  assert optim.decay_start_step(t) == 10
  t = _train_cfg(**{"train.steps": 1000, "train.warmup_steps": 10, "train.decay_start_ratio": 0.5,
                    "train.decay_start_step": 700}).train
  assert optim.decay_start_step(t) == 700  # the step wins over the ratio (MoC-PT)
  t = _train_cfg(**{"train.schedule": "cosine", "train.steps": 1000, "train.warmup_steps": 10,
                    "train.decay_start_ratio": 1.0}).train
  assert optim.decay_start_step(t) == 1000  # clamped to [W, steps]


def _one_update(config, grads_scale=1.0, steps=2):
  model = moc_jax.build_model(config)
  _, params = nnx.split(model, nnx.Param)
  tx = optim.make_optimizer(config.train, params)
  opt = tx.init(params)
  key = jax.random.key(1)
  history = [params]
  for _ in range(steps):
    key, sub = jax.random.split(key)
    leaves, treedef = jax.tree.flatten(params)
    noise = [grads_scale * jax.random.normal(k, x.shape) for k, x in
             zip(jax.random.split(sub, len(leaves)), leaves)]
    grads = jax.tree.unflatten(treedef, noise)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history, opt, tx


def _by_group(params):
  out = {}
  for path, v in nnx.to_flat_state(params):
    out.setdefault(moc_jax.param_groups(path), []).append((path, np.asarray(v[...] if hasattr(v, "__getitem__") else v)))
  return out


def test_first_update_has_zero_lr_and_groups_use_their_lr():
  """λ(0)=0: update 1 changes nothing except weight decay at lr 0 (i.e. nothing); update 2 uses λ(1)."""
  c = _train_cfg(**{"train.warmup_steps": 10, "train.base_lr": 1e-3, "train.memory_lr": 4e-3,
                    "train.bank_lr": 2e-3, "train.clip_norm": 0.0, "train.weight_decay": 0.0})
  hist, _, _ = _one_update(c, steps=2)
  p0, p1, p2 = (_by_group(h) for h in hist)
  for g in p0:
    for (_, a), (_, b) in zip(p0[g], p1[g]):
      np.testing.assert_array_equal(a, b)
  # Second update uses λ(1). After two Adam steps with (b1, b2) = (0.9, 0.95), Cauchy-Schwarz bounds
  # |m_hat|/sqrt(v_hat) by sqrt(sum a_i^2/b_i) = 1.0004 (a, b: the bias-corrected EMA weights).
  lam1 = 1 / 10
  a = np.array([0.9 * 0.1, 0.1]) / 0.19
  b = np.array([0.95 * 0.05, 0.05]) / 0.0975
  bound = np.sqrt(np.sum(a * a / b))
  for g, lr in {"base": 1e-3, "memory": 4e-3, "bank": 2e-3}.items():
    # float32 storage rounds p + delta to the parameter's ulp, hence the spacing term.
    excess = np.concatenate([(np.abs(b - a) - np.spacing(np.abs(a))).ravel() for (_, a), (_, b) in zip(p1[g], p2[g])])
    deltas = np.concatenate([np.abs(b - a).ravel() for (_, a), (_, b) in zip(p1[g], p2[g])])
    assert excess.max() <= lr * lam1 * bound, g
    assert deltas.max() >= 0.5 * lr * lam1, g


def test_bank_lr_zero_keeps_bank_bit_identical_but_clips_with_it():
  c = _train_cfg(**{"train.bank_lr": 0.0, "train.warmup_steps": 1})
  hist, opt, _ = _one_update(c, steps=3)
  for (_, a), (_, b) in zip(_by_group(hist[0])["bank"], _by_group(hist[-1])["bank"]):
    np.testing.assert_array_equal(a, b)
  moved = [np.any(a != b) for (_, a), (_, b) in zip(_by_group(hist[0])["base"], _by_group(hist[-1])["base"])]
  assert all(moved)


def test_freeze_bank_has_no_adam_state_for_the_bank():
  c_frozen = _train_cfg(**{"train.freeze_bank": True, "train.warmup_steps": 1})
  c_lr0 = _train_cfg(**{"train.bank_lr": 0.0, "train.warmup_steps": 1})
  hist, opt_frozen, _ = _one_update(c_frozen, steps=2)
  _, opt_lr0, _ = _one_update(c_lr0, steps=2)
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree) if x.ndim)  # moments, not step counters
  bank = moc_jax.count_params(c_frozen)["bank"]
  assert size(opt_lr0) - size(opt_frozen) == 2 * bank  # Adam mu and nu of the bank
  for (_, a), (_, b) in zip(_by_group(hist[0])["bank"], _by_group(hist[-1])["bank"]):
    np.testing.assert_array_equal(a, b)


def test_decoupled_weight_decay_matches_torch_adamw():
  """One hand-computed AdamW step (torch semantics: p -= lr*wd*p; p -= lr*m_hat/(sqrt(v_hat)+eps))."""
  c = _train_cfg(**{"train.schedule": "constant", "train.base_lr": 1e-2, "train.memory_lr": 1e-2,
                    "train.clip_norm": 0.0, "train.weight_decay": 0.1})
  model = moc_jax.build_model(c)
  _, params = nnx.split(model, nnx.Param)
  tx = optim.make_optimizer(c.train, params)
  opt = tx.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  updates, _ = tx.update(grads, opt, params)
  new = optax.apply_updates(params, updates)
  p = np.asarray(params["final_norm"]["scale"][...], np.float64)
  g = 0.5
  m_hat, v_hat = g, g * g
  want = p - 1e-2 * 0.1 * p - 1e-2 * m_hat / (np.sqrt(v_hat) + 1e-8)
  np.testing.assert_allclose(np.asarray(new["final_norm"]["scale"][...]), want, rtol=1e-6)


@pytest.mark.parametrize("bank_optimizer", ["dense", "lazy_adam"])
def test_bank_weight_decay_applies_to_the_bank_alone(bank_optimizer):
  """train.bank_weight_decay replaces train.weight_decay on the bank only: one hand-computed AdamW step
  (zero gradient, so the step is the decay alone) on a bank row and on a base parameter, in float64."""
  c = _train_cfg(**{"train.schedule": "constant", "train.base_lr": 1e-2, "train.memory_lr": 1e-2,
                    "train.bank_lr": 3e-2, "train.clip_norm": 0.0, "train.weight_decay": 0.1,
                    "train.bank_weight_decay": 0.25, "train.bank_optimizer": bank_optimizer})
  model = moc_jax.build_model(c)
  _, params = nnx.split(model, nnx.Param)
  tx = optim.make_optimizer(c.train, params)
  grads = jax.tree.map(jnp.zeros_like, params)
  if bank_optimizer == "dense":
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
  else:  # every chapter read, so the lazy step decays every row
    bank_grad = jax.tree.leaves(optim.split_bank(grads)[0])[0]
    rest_grads = optim.split_bank(grads)[1]
    read = jnp.ones(bank_grad.shape[:2], bool)
    new, _ = tx.apply(params, tx.init(params), rest_grads, bank_grad, read, jnp.zeros(()), jnp.asarray(True))
  (bank_path, bank), = _by_group(params)["bank"]
  (_, bank_new), = _by_group(new)["bank"]
  np.testing.assert_allclose(bank_new, np.float64(bank) * (1 - 3e-2 * 0.25), rtol=1e-6)
  scale = np.asarray(params["final_norm"]["scale"][...], np.float64)
  np.testing.assert_allclose(np.asarray(new["final_norm"]["scale"][...]), scale * (1 - 1e-2 * 0.1), rtol=1e-6)


_FIELDS = base_config().train.to_dict()  # every train field, at its default


@pytest.mark.parametrize("fields, want, asked", [
    # fields over the defaults -> the decoded update, (frozen, lazy, smf, sparse_gradient, state_layout, setting)
    ({}, optim.BankUpdate("dense"), (False, False, False, False, "dense", "bank_optimizer=dense")),
    ({"freeze_bank": True}, optim.BankUpdate("frozen"), (True, False, False, False, "none", "freeze_bank=True")),
    ({"bank_optimizer": "lazy_adam"}, optim.BankUpdate("lazy_adam"),
     (False, True, False, True, "lazy", "bank_optimizer=lazy_adam")),
    ({"bank_optimizer": "lazy_adam", "bank_state_memory": "pinned_host"},
     optim.BankUpdate("lazy_adam", state_memory="pinned_host"),
     (False, True, False, True, "lazy", "bank_optimizer=lazy_adam")),
    ({"bank_optimizer": "smf", "smf_top_t": 3}, optim.BankUpdate("smf", top_t=3, rank="tfidf"),
     (False, True, True, False, "lazy", "bank_optimizer=smf")),
    ({"bank_optimizer": "smf", "smf_top_t": 3, "bank_rule": "sgd", "smf_rank": "random"},
     optim.BankUpdate("smf", top_t=3, step="sgd", rank="random"),
     (False, True, True, False, "lazy", "bank_optimizer=smf"))])
def test_bank_update_decodes_each_setting(fields, want, asked):
  bank = optim.bank_update({**_FIELDS, **fields})
  assert bank == want
  assert (bank.frozen, bank.lazy, bank.smf, bank.sparse_gradient, bank.state_layout, bank.setting) == asked


def test_bank_update_of_a_loaded_config():
  assert optim.bank_update(_train_cfg(**{"train.bank_optimizer": "lazy_adam"}).train) == optim.BankUpdate("lazy_adam")


@pytest.mark.parametrize("freeze_bank", [False, True])
def test_bank_update_refuses_an_unknown_bank_optimizer_by_name(freeze_bank):
  want = r"^config\.train\.bank_optimizer: unknown value 'adam' — use one of \['dense', 'lazy_adam', 'smf'\]$"
  with pytest.raises(moc_jax.ConfigError, match=want):
    optim.bank_update({**_FIELDS, "bank_optimizer": "adam", "freeze_bank": freeze_bank})
