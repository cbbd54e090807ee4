"""Optax optimizer with MoC-PT's semantics (docs/mocpt_semantics.md).

AdamW(b1, b2, eps) with decoupled weight decay on every parameter, global-norm clipping of the full
gradient, and three parameter groups (base / memory layers / bank), each with its own peak LR, all
following one schedule multiplier λ(s). The n-th update uses λ(n-1), so the first update has lr 0
for warm-up schedules, exactly as MoC-PT's LambdaLR.

`train.bank_optimizer=lazy_adam` replaces the bank group's AdamW by lazy AdamW (`LazyBankOptimizer`): AdamW
over the chapters an update read (`chapters_read`), the other chapters' values and moments untouched, at a
cost that follows the chapters read. A product-key value table (memory.kind pkm / hml) is the bank too: its rows
are slots, and an update moves the slots it read. `train.bank_optimizer=smf` (sparse memory finetuning) is the same
update over another set of chapters: per bank the `train.smf_top_t` chapters the update read most against a
background (`smf_chapters`). Neither is MoC-PT's semantics; `dense` (the default) is. `bank_update` decodes
these settings and `train.freeze_bank` into one `BankUpdate`, which the train step, the loop and the state layout
ask in place of the config's strings; `frozen_groups` says which groups train.freeze_base and freeze_bank hold.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental.compute_on import compute_on

from moc_jax.config.plan import decay_start_step
from moc_jax.config.schema import BANK_OPTIMIZERS
from moc_jax.errors import ConfigError
from moc_jax.model.build import param_groups

GROUPS = ("base", "memory", "bank")


def schedule_multiplier(t) -> callable:
  """λ(s) for config.train `t`: wsd | cosine | linear | constant (MoC-PT utils.py; docs/mocpt_semantics.md#lr-schedules)."""
  total, warmup, r = t.steps, t.warmup_steps, t.min_lr_ratio
  if t.schedule == "constant":  # HF get_scheduler("constant") ignores warm-up
    return lambda s: jnp.ones_like(jnp.asarray(s, jnp.float32))
  decay_start = decay_start_step(t)

  def decay(s):  # from 1 at the decay start: cosine to r (cosine, wsd), or linear to 0 ignoring r (MoC-PT's)
    if t.schedule == "linear":
      return jnp.maximum(0.0, (total - s) / max(total - decay_start, 1))
    progress = (s - decay_start) / max(total - decay_start, 1)
    return r + (1 - r) * 0.5 * (1 + jnp.cos(math.pi * progress))

  def multiplier(s):  # warm-up, hold at the peak until the decay start, decay
    s = jnp.asarray(s, jnp.float32)
    return jnp.where(s < warmup, s / max(warmup, 1), jnp.where(s < decay_start, 1.0, decay(s)))
  return multiplier


def group_lrs(t) -> dict[str, float]:
  return {"base": t.base_lr, "memory": t.memory_lr,
          "bank": t.memory_lr if t.bank_lr is None else t.bank_lr}


def group_weight_decays(t) -> dict[str, float]:
  """Every group decays at train.weight_decay (MoC-PT) except the bank under train.bank_weight_decay."""
  bank = t.weight_decay if t.bank_weight_decay is None else t.bank_weight_decay
  return {"base": t.weight_decay, "memory": t.weight_decay, "bank": bank}


def group_labels(params):
  """Same-structure tree of 'base' | 'memory' | 'bank' labels for an nnx.State of params."""
  return nnx.map_state(lambda path, _: param_groups(path), params)


class LazyAdamState(NamedTuple):
  """The bank's lazy AdamW state. `count`: per chapter, the updates that read it, int32 [banks, chapters] for each
  bank leaf, in a tree shaped like the parameters so that the chapter padding (padding.py: axis 1 under
  `bank/memory`) and the shardings (logical names ("banks", "chapters")) treat it as they treat the moments.
  `mu`, `nu`: Adam's moments, like the parameters."""
  count: optax.Updates
  mu: optax.Updates
  nu: optax.Updates


class SparseRows(NamedTuple):
  """One bank's gradient on the chapters it names: `ids` [K] chapter ids, distinct (slots past them name
  chapter C, one past the last: nothing), `values` [K, T, dm] d loss / d bank[ids]. Any other chapter's
  gradient is zero."""
  ids: jax.Array
  values: jax.Array


def _chapter_counts(p):
  """Zero counts [banks, chapters] for a bank leaf [banks, chapters, ...]; an nnx Variable keeps the first two
  of its parameter's logical axis names, so the counts shard along the chapters as the bank does."""
  counts = jnp.zeros(p.shape[:2], jnp.int32)
  if not isinstance(p, nnx.Variable):
    return counts
  names = p.get_metadata().get("out_sharding")
  return p.replace(counts, out_sharding=None if names is None else tuple(names[:2]))


def lazy_adamw_rows(g, m, v, count, p, read, lr, b1, b2, eps, weight_decay):
  """Lazy AdamW on rows of the bank: g, m, v, p [..., chapters or K, ...] with `read` and `count` over their
  leading chapter axes. A read row takes one AdamW step (the formulas of optax.scale_by_adam and
  add_decayed_weights, then `lr`, the signed schedule LR, as optax.scale_by_schedule applies it) with its
  own step count in the bias correction; any other row keeps its value, moments and count bit for bit.
  -> (p, m, v, count)."""
  count = count + read.astype(count.dtype)
  read = read.reshape(read.shape + (1,) * (g.ndim - read.ndim))
  m = jnp.where(read, (1 - b1) * g + b1 * m, m)
  v = jnp.where(read, (1 - b2) * (g ** 2) + b2 * v, v)
  steps = jnp.maximum(count, 1).reshape(read.shape)  # a never-read chapter divides by 1 - b**1, not by 0
  m_hat = m / (1 - b1 ** steps).astype(m.dtype)
  v_hat = v / (1 - b2 ** steps).astype(v.dtype)
  update = lr * jnp.where(read, m_hat / (jnp.sqrt(v_hat) + eps) + weight_decay * p, 0)
  return jnp.where(read, (p + update).astype(p.dtype), p), m, v, count


def lazy_sgd_rows(g, m, v, count, p, read, lr, *hyper):
  """`lazy_adamw_rows` with SGD's step (train.bank_rule=sgd): a read row moves by `lr` (the signed schedule LR)
  times its gradient, with no moments and no weight decay, so nothing but the gradient of an update moves a row (the
  rule sparse memory finetuning forgets least with); m and v stay as they are. -> (p, m, v, count)."""
  del hyper
  count = count + read.astype(count.dtype)
  read = read.reshape(read.shape + (1,) * (g.ndim - read.ndim))
  return jnp.where(read, (p + lr * g).astype(p.dtype), p), m, v, count


class LazyBankState(NamedTuple):
  """The optimizer state of `bank_optimizer=lazy_adam | smf`: the other groups' (`rest`), the bank's lazy
  Adam state, and the updates taken (`count`: the schedule's step, as optax.scale_by_schedule counts)."""
  rest: optax.OptState
  bank: LazyAdamState
  count: jax.Array


def split_bank(params):
  """(the bank as a one-leaf tree {"bank": {"memory": ...}} (paths under it stay `bank/memory`), the rest);
  nnx.merge_state(rest, bank) joins them again."""
  return params.split(nnx.PathContains("bank"), ...)


def without_bank(params):
  return split_bank(params)[1]


class LazyBankOptimizer(NamedTuple):
  """AdamW over chapters for the bank, optax AdamW for the other groups (`bank_optimizer=lazy_adam | smf`).

  An update moves the chapters of a `read` mask, bool [banks, chapters] (the padded chapter axis; see
  `chapters_read` and `smf_chapters`). A marked chapter takes one AdamW step: its moments absorb its
  gradient, its bias correction uses its own count of marked updates (a chapter read for the first time at
  update 500 is corrected as at step 1), and decoupled weight decay applies. An unmarked chapter keeps its
  value, moments and count bit for bit: its weight decay is skipped, not caught up later, because catching
  up exactly needs the LR of every skipped update (torch SparseAdam and TF LazyAdam skip it too).

  The bank lives apart from the optax chain so that its gradient can be sparse (`SparseRows` per bank):
  then the update gathers the named rows of the bank and its state, steps them and scatters them back,
  costing O(chapters read), not O(bank). A dense bank gradient (the chapter-sharded bank; smf) takes the same
  step as a masked elementwise update over the whole bank. Clipping is by the global norm of the whole
  gradient, the bank's included, with optax.clip_by_global_norm's formula (`apply`).
  """
  rest: optax.GradientTransformation
  bank_lr: callable  # update count -> signed bank LR
  clip_norm: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  sgd: bool = False  # train.bank_rule=sgd: `lazy_sgd_rows` instead of `lazy_adamw_rows`

  @property
  def rows_step(self):
    return lazy_sgd_rows if self.sgd else lazy_adamw_rows

  def init(self, params) -> LazyBankState:
    bank, rest = split_bank(params)
    counts = jax.tree.map(_chapter_counts, bank, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return LazyBankState(rest=self.rest.init(rest),
                         bank=LazyAdamState(count=counts, mu=optax.tree.zeros_like(bank),
                                            nu=optax.tree.zeros_like(bank)),
                         count=jnp.zeros((), jnp.int32))

  def global_norm(self, rest_grads, bank_grad):
    """The norm of the whole gradient: `bank_grad` a dense [banks, chapters, ...] array or a SparseRows per
    bank (the chapters absent from it have zero gradient)."""
    parts = [bank_grad] if not isinstance(bank_grad, (list, tuple)) else [r.values for r in bank_grad]
    return optax.global_norm((rest_grads, parts))

  def apply(self, params, state, rest_grads, bank_grad, read, grad_norm, ok):
    """One update -> (params, state); when not `ok` (non-finite), both as they were. `read` may be None with a
    sparse `bank_grad`: the rows it names are the rows read (a product-key table's update)."""
    if self.clip_norm > 0:  # optax.clip_by_global_norm, over the whole gradient
      clip = lambda g: jnp.where(grad_norm < self.clip_norm, g, (g / grad_norm.astype(g.dtype)) * self.clip_norm)  # noqa: E731
      rest_grads = jax.tree.map(clip, rest_grads)
      bank_grad = ([r._replace(values=clip(r.values)) for r in bank_grad] if isinstance(bank_grad, (list, tuple))
                   else clip(bank_grad))
    tree, rest = split_bank(params)
    updates, rest_state = self.rest.update(rest_grads, state.rest, rest)
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    rest, rest_state = jax.tree.map(keep, (optax.apply_updates(rest, updates), rest_state), (rest, state.rest))
    lr = self.bank_lr(state.count)
    hyper = (self.b1, self.b2, self.eps, self.weight_decay)
    (p,), treedef = jax.tree.flatten(tree)
    (n,), (m,), (v,) = (jax.tree.leaves(x) for x in state.bank)
    if isinstance(bank_grad, (list, tuple)):
      p, m, v, n = _sparse_step(self.rows_step, bank_grad, p, m, v, n, read, ok, lr, hyper)
    else:
      new = self.rows_step(bank_grad, m, v, n, p, read, lr, *hyper)
      p, m, v, n = (keep(a, b) for a, b in zip(new, (p, m, v, n)))
    bank = LazyAdamState(*(jax.tree.unflatten(jax.tree.structure(x), [y]) for x, y in zip(state.bank, (n, m, v))))
    params = nnx.merge_state(rest, treedef.unflatten([p]))
    return params, LazyBankState(rest_state, bank, state.count + ok.astype(state.count.dtype))


def _sparse_step(rows_step, rows, p, m, v, n, read, ok, lr, hyper):
  """`rows_step` (`lazy_adamw_rows` or `lazy_sgd_rows`) on the named rows of each bank: gather, step, scatter back (slots naming chapter C
  read nothing and write nothing); `read` None steps every row named. Moments and counts in host memory (`train.bank_state_memory=pinned_host`)
  are read and written there, row by row (`_host_take`, `_host_put`)."""
  host = _in_host_memory(m)
  for b, r in enumerate(rows):
    take = lambda x, fill=0: x[b].take(r.ids, axis=0, mode="fill", fill_value=fill)  # noqa: E731
    if host:
      index, real = _host_index(b, r.ids, p.shape[1])
      state = [jax.device_put(_host_take(x, index), jax.memory.Space.Device) for x in (m, v, n)]
      state = [jnp.where(_rows_mask(real, x), x, jnp.zeros_like(x)) for x in state]
    else:
      state = [take(m), take(v), take(n)]
    old = (take(p), *state)
    named = r.ids < p.shape[1] if read is None else take(read, False)
    new = rows_step(r.values, old[1], old[2], old[3], old[0], named, lr, *hyper)
    new = [jnp.where(ok, a, o) for a, o in zip(new, old)]
    p = p.at[b, r.ids].set(new[0], mode="drop")
    if host:  # the empty slots write slot 0's row (so every write to that row carries the same value)
      m, v, n = (_host_put(x, index, jax.device_put(jnp.where(_rows_mask(real, y), y, y[:1]), jax.memory.Space.Host))
                 for x, y in zip((m, v, n), new[1:]))
    else:
      m, v, n = (x.at[b, r.ids].set(y, mode="drop") for x, y in zip((m, v, n), new[1:]))
  return p, m, v, n


def _in_host_memory(x):
  aval = jax.typeof(x)
  return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def _rows_mask(real, x):
  return real.reshape(real.shape + (1,) * (x.ndim - 1))


def _host_index(bank, ids, chapters):
  """[K, 2] (bank, chapter) pairs in bounds (empty slots name slot 0's chapter), in host memory, and which
  slots are real. Host computation takes no device constants, so the index is finished on the device."""
  real = ids < chapters
  ids = jnp.where(real, ids, jnp.minimum(ids[0], chapters - 1))
  index = jnp.stack([jnp.full_like(ids, bank), ids], axis=1)
  return jax.device_put(index, jax.memory.Space.Host), real


def _host_take(x, index):
  """x[index[:, 0], index[:, 1]] computed where x lives (host memory); `index` in bounds."""
  dims = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(1, x.ndim - 1)), collapsed_slice_dims=(0, 1),
                                        start_index_map=(0, 1))

  @functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  def take(x, index):
    return jax.lax.gather(x, index, dims, (1, 1) + x.shape[2:], mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return take(x, index)


def _host_put(x, index, rows):
  """x with rows written at index[:, 0], index[:, 1], computed in host memory; `index` in bounds, a repeated
  index written with one value."""
  dims = jax.lax.ScatterDimensionNumbers(update_window_dims=tuple(range(1, x.ndim - 1)),
                                         inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0, 1))

  @functools.partial(compute_on, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  def put(x, index, rows):
    return jax.lax.scatter(x, index, rows, dims, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return put(x, index, rows)


def chapters_read(load, bank_ids, num_shared, chapters):
  """The chapter mask of an update, bool [banks, chapters]: the chapters any routing decision selected
  (`load` [memory layers, C], routed selections per chapter summed over the update's micro-batches; memory
  layer i reads bank `bank_ids[i]`), every shared chapter (always read), and never the chapters padded for
  sharding (`chapters` - C of them, at the end)."""
  banks = max(bank_ids) + 1
  routed = jax.ops.segment_sum(load, jnp.asarray(bank_ids), num_segments=banks) > 0
  read = routed | (jnp.arange(load.shape[-1]) < num_shared)
  return jnp.pad(read, ((0, 0), (0, chapters - load.shape[-1])))


def smf_chapters(read, bank_ids, idf, top_t, chapters, rank="tfidf", key=None):
  """Sparse memory finetuning's chapter mask, bool [banks, chapters]: per bank the `top_t` chapters of highest
  TF-IDF score tf·idf, where tf [memory layers, C] is how much the update read each chapter (chapter weights
  summed over its decisions and micro-batches; `model.routing.read_weight`), summed over the layers reading the
  bank, and idf [banks, C] (`bank_background.idf`) is high for chapters pre-training rarely read. Ties (e.g.
  unread chapters at score 0 when fewer than top_t were read) go to the lower chapter id; the chapters padded
  for sharding (`chapters` - C, at the end) are never chosen. `rank` (train.smf_rank) names the method or one of
  its controls: tf scores tf alone (no idf); random scores the chapters read by a uniform draw of `key` (the others
  0, so a read chapter always ranks first)."""
  banks, c = idf.shape
  tf = jax.ops.segment_sum(read, jnp.asarray(bank_ids), num_segments=banks)
  if rank == "random":
    tf = jnp.where(tf > 0, jax.random.uniform(key, tf.shape, minval=1.0, maxval=2.0), 0.0)
  score = jnp.pad(tf * (idf if rank == "tfidf" else 1.0), ((0, 0), (0, chapters - c)), constant_values=-jnp.inf)
  _, top = jax.lax.top_k(score, top_t)
  return jnp.zeros((banks, chapters), bool).at[jnp.arange(banks)[:, None], top].set(True)


@dataclasses.dataclass(frozen=True)
class BankUpdate:
  """How an update moves the memory bank: train.freeze_bank, bank_optimizer, smf_top_t and bank_state_memory
  decoded once (`bank_update`). The optimizer is built from it and the train step, the loop and the state layout
  ask it, so that no two modules can read those fields differently.

  `rule`: "frozen" (freeze_bank: the bank out of the optimizer, no gradient and no state; bank_lr=0 is not this,
  it keeps the bank's Adam state), "dense" (AdamW over every chapter, MoC-PT's), "lazy_adam" (AdamW over the
  chapters an update read) or "smf" (the same over the `top_t` chapters per bank the update read most against a
  background). `state_memory`: the memory kind holding the lazy state off the device; None on the device. `step`
  and `rank`: train.bank_rule and (smf) train.smf_rank."""
  rule: str
  top_t: int | None = None
  state_memory: str | None = None
  step: str = "adamw"         # train.bank_rule: the row step of a lazy rule
  rank: str | None = None     # train.smf_rank: smf's ranking (tfidf, or a control)

  @property
  def frozen(self) -> bool:
    return self.rule == "frozen"

  @property
  def lazy(self) -> bool:
    """The bank is stepped apart from the optax chain, chapter by chapter (`LazyBankOptimizer`)."""
    return self.rule in ("lazy_adam", "smf")

  @property
  def smf(self) -> bool:
    """The chapters moved are SMF's top-t (`smf_chapters`: it needs the background's idf and the update's chapter
    reads) rather than the chapters read (`chapters_read`)."""
    return self.rule == "smf"

  @property
  def sparse_gradient(self) -> bool:
    """The bank's gradient may be taken as the rows read (`SparseRows`): lazy_adam moves those rows alone, while
    smf's top-t may name chapters the update did not read (ties at score 0), so it takes the dense gradient."""
    return self.rule == "lazy_adam"

  @property
  def state_layout(self) -> str:
    """The bank's optimizer state as a checkpoint holds it: "none", "dense" (AdamW's moments) or "lazy" (moments
    and per-chapter counts, lazy_adam's and smf's alike); a run resumes only into the layout it saved."""
    if self.frozen:
      return "none"
    return "lazy" if self.lazy else "dense"

  @property
  def setting(self) -> str:
    """The config setting that selects the rule, as a user writes it (for messages)."""
    return "freeze_bank=True" if self.frozen else f"bank_optimizer={self.rule}"


def bank_update(t) -> BankUpdate:
  """The `BankUpdate` of config.train `t` (a ConfigDict, or a dict holding every train field). freeze_bank wins
  over bank_optimizer (validation refuses the two together); an unknown bank_optimizer is a ConfigError rather
  than some other rule's update."""
  kind = t["bank_optimizer"]
  if kind not in BANK_OPTIMIZERS:
    raise ConfigError(f"config.train.bank_optimizer: unknown value {kind!r} — use one of {list(BANK_OPTIMIZERS)}")
  rule = "frozen" if t["freeze_bank"] else kind
  memory = t["bank_state_memory"]
  return BankUpdate(rule, top_t=t["smf_top_t"] if rule == "smf" else None,
                    state_memory=None if memory == "device" else memory, step=t["bank_rule"],
                    rank=t["smf_rank"] if rule == "smf" else None)


def frozen_groups(t) -> tuple[str, ...]:
  """The parameter groups out of the optimizer: train.freeze_base drops the backbone ('base'), train.freeze_bank the
  bank. The train step stops their gradient and the optimizer holds them (`hold`): no Adam state, no update."""
  return tuple(g for g, frozen in (("base", t.freeze_base), ("bank", bank_update(t).frozen)) if frozen)


def hold() -> optax.GradientTransformation:
  """The update of a frozen group: -0.0 everywhere, as p + -0.0 is p bit for bit (p + 0.0 would turn a -0.0 into
  0.0); stateless, as optax.set_to_zero."""
  return optax.stateless(lambda updates, params: jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates))


def make_optimizer(t, params):
  """The full update rule: an optax chain (clipping, then the groups), or for a lazy `bank_update` a
  `LazyBankOptimizer` (the bank apart, see there). Frozen groups (`frozen_groups`) are held."""
  bank = bank_update(t)
  lam = schedule_multiplier(t)
  lrs = group_lrs(t)

  def group_tx(lr, *direction):
    return optax.chain(*direction, optax.scale_by_schedule(lambda s: -lr * lam(s)))

  wds = group_weight_decays(t)
  transforms = {g: group_tx(lrs[g], optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
                            optax.add_decayed_weights(wds[g])) for g in GROUPS}
  transforms.update({g: hold() for g in frozen_groups(t)})
  if bank.lazy:
    params, transforms = without_bank(params), {g: tx for g, tx in transforms.items() if g != "bank"}
  labels = group_labels(params)
  if "fixed" in jax.tree.leaves(labels):  # the aux-free balance bias: no gradient step, no weight decay
    transforms["fixed"] = optax.set_to_zero()
  groups = optax.multi_transform(transforms, labels)
  if bank.lazy:
    return LazyBankOptimizer(groups, lambda s: -lrs["bank"] * lam(s), t.clip_norm, t.b1, t.b2, t.eps,
                             wds["bank"], sgd=bank.step == "sgd")
  chain = [optax.clip_by_global_norm(t.clip_norm)] if t.clip_norm > 0 else []
  return optax.chain(*chain, groups)


def current_lrs(t, update_count) -> dict[str, float]:
  """The LR each group used for update number `update_count` (0-based), for logging."""
  lam, frozen = float(schedule_multiplier(t)(update_count)), frozen_groups(t)
  return {g: lr * lam * (0.0 if g in frozen else 1.0) for g, lr in group_lrs(t).items()}
