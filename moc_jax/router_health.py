"""Is the router using the bank? Per memory layer, from routed selections counted over a window of decisions
(training's log window, or an evaluation split): the share of routable chapters read at all and the max/mean
load; and the two signs of collapse a training log warns about once.

A collapsed router reads the same few chapters for every input (MoC-PT's load-balance term even rewards
moving all probability onto the always-read shared chapter), so the bank stops mattering; these numbers show
it while the run is still going.
"""
from __future__ import annotations

import numpy as np

# per memory layer, from the model's router stats (bias_spread: aux-free balancing; pool_share: attention pooling)
STEP_STATS = ("shared_mass", "routed_entropy", "bias_spread", "pool_share")
COLLAPSED_USED_FRAC = 0.25     # fewer routable chapters than this share read over a window
COLLAPSED_SHARED_MASS = 0.9    # more router probability than this on the shared chapters


def load_stats(load, num_shared) -> dict:
  """load [C] routed selections per chapter -> used_frac (routable chapters selected at least once) and
  max_load (the most selected chapter's count over the mean count of routable chapters; 1 = perfectly even)."""
  routable = np.asarray(load, np.float64)[num_shared:]
  mean = routable.mean()
  return {"used_frac": float((routable > 0).mean()), "max_load": float(routable.max() / mean) if mean else 0.0}


def collapse(stats: dict) -> str | None:
  """Why a layer's router counts as collapsed ({used_frac, shared_mass}), or None."""
  if stats.get("used_frac", 1.0) < COLLAPSED_USED_FRAC:
    return f"only {stats['used_frac']:.0%} of routable chapters read"
  if stats.get("shared_mass", 0.0) > COLLAPSED_SHARED_MASS:
    return f"{stats['shared_mass']:.1%} of router probability on the shared chapters"
  return None
