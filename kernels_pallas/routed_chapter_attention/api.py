"""One entry point for attention from every token to its own routed chapters (the `contract`).

The implementations (`reference`, `xla`, `pallas`) never import one another: choosing among them is this
module's job alone, so each can be read, tested and replaced on its own. `implementation`:
  "reference"  the gathered oracle (tests only: it materialises K/V per (token, slot));
  "xla"        plain XLA, never gathers keys per (token, slot);
  "pallas"     the TPU Mosaic / GPU kernels, in interpret mode on CPU;
  "auto"       the fallback chain: the first implementation of REGISTRY, in order, native to the
               target platform (`contract.target_platform`: the active mesh's devices', else the default
               backend). That is the kernels on TPU and GPU and XLA everywhere else, so a
               backend without kernels still runs and never gets the oracle.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kernels_pallas.routed_chapter_attention import contract, pallas, reference, xla


class Implementation(NamedTuple):
  """attend(q, k, v, ids, logit_scale, value_scale, combine, *, return_lse) per `contract`, plus
  `interpret=` when takes_interpret (the other implementations have no interpreter to configure).
  platforms: the platforms it is native to, where "auto" may pick it (None: any; (): none)."""
  attend: Callable[..., Any]
  platforms: tuple[str, ...] | None
  takes_interpret: bool = False

  def native_to(self, backend: str) -> bool:
    return self.platforms is None or backend in self.platforms


REGISTRY = {  # in the order "auto" tries them; xla, native everywhere, ends the chain
    "pallas": Implementation(pallas.routed_chapter_attention, ("tpu", "gpu"), takes_interpret=True),
    "xla": Implementation(xla.routed_chapter_attention, None),
    "reference": Implementation(reference.routed_chapter_attention, ()),
}
IMPLEMENTATIONS = ("auto", *REGISTRY)


def resolve(implementation: str) -> str:
  """The registry name `implementation` stands for on the target platform; raises ValueError if unknown."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation != "auto":
    return implementation
  backend = contract.target_platform()
  return next(name for name, entry in REGISTRY.items() if entry.native_to(backend))


def routed_chapter_attention(q, k, v, ids, logit_scale, value_scale, *, combine="joint",
                             implementation="auto", interpret=None, return_lse=False):
  """See `contract` for the arguments and results; `implementation` as in this module's docstring.

  interpret (pallas only): None = interpret mode exactly when the target platform is CPU; True = the
  generic interpreter; a pltpu.InterpretParams = the TPU simulator.
  """
  contract.check_arguments(q, k, v, ids, logit_scale, value_scale, combine, return_lse)
  entry = REGISTRY[resolve(implementation)]
  options = {"interpret": interpret} if entry.takes_interpret else {}
  return entry.attend(q, k, v, ids, logit_scale, value_scale, combine, return_lse=return_lse, **options)
