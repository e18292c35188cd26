"""bitsandbytes' optimizer internals hf_rtp uses (DESIGN.md, "Private names"): what integrations/bitsandbytes.py
reaches to give a rotated parameter its 8-bit state as bitsandbytes' own first step would, with the block scales
made this rank's blocks. None of them is documented API (`init_state`, `get_config`, `check_overrides`, the
`initialized` and `is_paged` fields of `Optimizer8bit`, its state's keys), so they are gated as private names.

bitsandbytes is never imported here at the top: hf_rtp imports it only where a quantized load or one of its
optimizers needs it (DESIGN.md, import cost). Each function is called with one of bitsandbytes' optimizers in
hand, so bitsandbytes is imported already; `is_optimizer` looks only in sys.modules.
"""

from __future__ import annotations

import sys
from typing import Any

from .gate import lookup

TESTED = ">=0.50,<0.51"  # pyproject.toml's bounds (the bitsandbytes extra); .ci/pinned.txt pins 0.50.2

# an 8-bit (or 32-bit) optimizer's state per parameter: its moments, their block scales and their code maps
MOMENTS = ("state1", "state2")
SCALES = ("absmax1", "absmax2")
CODE_MAPS = ("qmap1", "qmap2")


def _get(owner: Any, name: str) -> Any:
    import bitsandbytes  # imported already wherever these run (see above)

    return lookup(owner, name, "bitsandbytes", bitsandbytes.__version__, TESTED)


def is_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is one of bitsandbytes' (its base `Optimizer8bit`: 8-bit, 32-bit and paged alike).
    False without importing bitsandbytes when nothing did; the version is checked for bitsandbytes' optimizers
    only, so that another optimizer steps as before beside an untested bitsandbytes."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    if module is None:
        return False
    base = getattr(module, "Optimizer8bit", None)
    if base is not None:
        own = isinstance(optimizer, base)
    else:  # gone: the lookup below fails naming it, for bitsandbytes' own optimizers only
        own = any(c.__module__.startswith("bitsandbytes.") for c in type(optimizer).__mro__)
    if own:
        _get(module, "Optimizer8bit")  # the version gate
    return own


def apply_overrides(optimizer: Any) -> None:
    """What bitsandbytes' first step does before its init_state: the per-module overrides of GlobalOptimManager."""
    if not _get(optimizer, "initialized"):
        _get(optimizer, "check_overrides")()


def max_unorm(optimizer: Any, gindex: int, pindex: int, group: dict) -> float:
    """The parameter's `max_unorm` (LAMB's and LARS's bound by the whole tensor's norm; 0.0 for none)."""
    return _get(optimizer, "get_config")(gindex, pindex, group)["max_unorm"]


def paged(optimizer: Any) -> bool:
    """Whether the optimizer keeps its state in paged memory (its `is_paged`)."""
    return _get(optimizer, "is_paged")


def set_paged(optimizer: Any, on: bool) -> None:
    _get(optimizer, "is_paged")
    optimizer.is_paged = on


def first_state(optimizer: Any, group: dict, p: Any, gindex: int, pindex: int) -> None:
    """bitsandbytes' own first state of `p` (8-bit or 32-bit by its size and the optimizer's settings)."""
    _get(optimizer, "init_state")(group, p, gindex, pindex)
