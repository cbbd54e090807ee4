"""Where a run's numbers go: metrics.jsonl (the record), TensorBoard events, loss.png, and the console
(a progress bar on a terminal; plain log lines when not a TTY or when CI is set)."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import numpy as np

from moc_jax.config import memory_layers
from moc_jax.router_health import STEP_STATS, collapse, load_stats

log = logging.getLogger("moc_jax")


def use_progress_bar(mode: str) -> bool:
  if mode in ("bar", "log"):
    return mode == "bar"
  return sys.stderr.isatty() and not os.environ.get("CI")


class MetricsWriter:
  def __init__(self, workdir: str, total_steps: int, start_step: int, progress: str = "auto"):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.png = os.path.join(workdir, "loss.png")
    self.rows = _read_rows(self.path, keep_through=start_step)
    _write_rows(self.path, self.rows)  # drops rows a killed run logged after its last checkpoint
    from tensorboardX import SummaryWriter
    self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step + 1)
    self.bar = None
    if use_progress_bar(progress):
      from tqdm import tqdm
      self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self.t0 = time.time()
    self.total, self.start = total_steps, start_step

  def write(self, row: dict) -> None:
    row = {k: (float(v) if isinstance(v, (np.floating, np.integer)) or hasattr(v, "dtype") else v)
           for k, v in row.items()}
    self.rows.append(row)
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    prefix = row.get("split", "train")
    for k, v in row.items():
      if k not in ("step", "split") and isinstance(v, (int, float)) and math.isfinite(v):
        self.tb.add_scalar(f"{prefix}/{k}", v, row["step"])
    self._console(row)

  def _console(self, row):
    if "split" in row:
      msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
      (self.bar.write if self.bar else print)(f"[eval] {msg}", **({} if self.bar else {"flush": True}))
      return
    if self.bar:
      self.bar.n = row["step"]
      self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
      self.bar.refresh()
    else:
      done = row["step"] - self.start
      eta = (time.time() - self.t0) / max(done, 1) * (self.total - row["step"])
      print(f"step {row['step']}/{self.total} loss={row['loss']:.4f} ce={row['ce']:.4f} aux={row['aux']:.4f} "
            f"lr={row['lr']:.3g} gnorm={row['grad_norm']:.3f} tok/s={row['tokens_per_s']:.0f} "
            f"mfu={row.get('mfu', float('nan')):.1%} "
            f"data_wait={row['data_wait_frac']:.3f} eta={eta:.0f}s", flush=True)

  def plot(self) -> None:
    """Redraws loss.png: train CE and loss, validation CE (and fact recall when measured); the cool-downs'
    (train.cooldowns) as stars where their decays ended."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train = [r for r in self.rows if "split" not in r]
    val = [r for r in self.rows if r.get("split") == "validation"]
    recall = [r for r in val if "probe_acc" in r]
    cooled = [r for r in self.rows if r.get("split") == "cooldown"]
    health = sorted(k[len("router_used_frac_"):] for k in (train[-1] if train else {}) if k.startswith("router_used_frac_"))
    panels = 1 + bool(recall) + bool(health)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    ax = axes[0, 0]
    ax.plot([r["step"] for r in train], [r["ce"] for r in train], label="train CE", alpha=0.7)
    ax.plot([r["step"] for r in val], [r["ce"] for r in val], "o-", label="validation CE")
    if cooled:
      ax.plot([r["cooldown_end"] for r in cooled], [r["ce"] for r in cooled], "*", ms=10, label="validation CE, cooled")
    ax.set_xlabel("step"), ax.set_ylabel("cross-entropy (nats/token)"), ax.legend(), ax.grid(alpha=0.3)
    if recall:
      ax = axes[0, 1]
      ax.plot([r["step"] for r in recall], [r["probe_acc"] for r in recall], "o-", label="fact recall (choice)")
      ax.plot([r["step"] for r in recall], [r["probe_exact"] for r in recall], "s-", label="greedy exact match")
      if cooled:
        ax.plot([r["cooldown_end"] for r in cooled], [r["probe_acc"] for r in cooled], "*", ms=10,
                label="fact recall, cooled")
      ax.axhline(recall[-1]["probe_chance"], ls="--", c="gray", label="chance")
      ax.set_xlabel("step"), ax.set_ylabel("accuracy"), ax.set_ylim(0, 1), ax.legend(), ax.grid(alpha=0.3)
    if health:
      _plot_router_health(axes[0, -1], [r for r in train if f"router_used_frac_{health[0]}" in r], health)
    fig.tight_layout()
    fig.savefig(self.png, dpi=100)
    plt.close(fig)

  def close(self) -> None:
    self.tb.close()
    if self.bar:
      self.bar.close()


def _plot_router_health(ax, rows, layers):
  """Per memory layer: the share of routable chapters read in each log window, and the router probability
  on the shared chapters (both near 1 and near 0 respectively when the bank is used; cluster routing has no router,
  so no probability)."""
  steps = [r["step"] for r in rows]
  for layer in layers:
    line, = ax.plot(steps, [r[f"router_used_frac_{layer}"] for r in rows], label=f"chapters read, {layer}")
    if f"router_shared_mass_{layer}" in rows[0]:
      ax.plot(steps, [r[f"router_shared_mass_{layer}"] for r in rows], "--", c=line.get_color(),
              label=f"shared-chapter mass, {layer}")
  ax.set_xlabel("step"), ax.set_ylabel("fraction"), ax.set_ylim(0, 1.02), ax.set_title("router health")
  ax.legend(fontsize=7), ax.grid(alpha=0.3)


class RouterWindow:
  """Router health per memory layer for the training log: routed selections summed on the device over the log
  window (no host sync per step), turned at each log row into `router_used_frac_L<layer>` and
  `router_max_load_L<layer>`, next to the logged step's `router_shared_mass_L<layer>`,
  `router_routed_entropy_L<layer>` (and `router_bias_spread_L<layer>` with aux-free balancing,
  `router_pool_share_L<layer>` with attention pooling). The first time a layer looks collapsed
  (router_health.collapse) the log says so, once."""

  def __init__(self, config):
    self.layers, self.num_shared = memory_layers(config), config.memory.num_shared
    self.load, self.warned = None, set()

  def add(self, metrics) -> None:
    if "router_load" in metrics:
      self.load = metrics["router_load"] if self.load is None else self.load + metrics["router_load"]

  def row(self, step, metrics) -> dict:
    """The window's health columns (metrics: the logged step's, on the host); starts the next window."""
    if self.load is None:
      return {}
    load, self.load = np.asarray(self.load), None
    out = {}
    for i, layer in enumerate(self.layers):
      stats = {**load_stats(load[i], self.num_shared),
               **{k: float(metrics[f"router_{k}"][i]) for k in STEP_STATS if f"router_{k}" in metrics}}
      out.update({f"router_{k}_L{layer}": v for k, v in stats.items()})
      reason = collapse(stats)
      if reason and layer not in self.warned:
        self.warned.add(layer)
        log.warning("moc_jax: step %d: the router of memory layer %d looks collapsed (%s over the last log "
                    "window); see memory.load_balance in the README's routing section", step, layer, reason)
    return out


def _read_rows(path, keep_through):
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a kill
      if row.get("step", 0) <= keep_through:
        rows.append(row)
  return rows


def _write_rows(path, rows):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, path)
