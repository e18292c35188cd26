"""torchao's optimizer internals hf_rtp uses (DESIGN.md, "Private names"): what integrations/torchao.py reaches
to step torchao's AdamW8bit and Adam8bit on each rank's rows. The 8-bit state's tensor class and its code maps
(`torchao.optim.subclass_8bit`: `OptimState8bit`, `get_qmap_signed`, `get_qmap_unsigned`), the optimizers'
module (`torchao.optim.adam`) and their `block_size` and `bf16_stochastic_round` fields are no documented API,
so they are gated as private names.

torchao is never imported here at the top (hf_rtp does not depend on it, and transformers imports it in every
process that imports PEFT): each function runs with one of torchao's optimizers in hand, so torchao is imported
already; `stepped_classes` looks only in sys.modules.
"""

from __future__ import annotations

import sys
from typing import Any

from .gate import lookup

TESTED = ">=0.18,<0.19"  # the release checked: .ci/run installs torchao==0.18.0 (no pyproject.toml bound)


def _get(owner: Any, name: str) -> Any:
    import torchao  # imported already wherever these run (see above)

    return lookup(owner, name, "torchao", torchao.__version__, TESTED)


def stepped_classes(names: tuple[str, ...]) -> tuple[type, ...] | None:
    """torchao's optimizer classes `names` (from `torchao.optim.adam`), or None when that module was never
    imported. The version gate for a torchao optimizer over rotated parameters."""
    adam = sys.modules.get("torchao.optim.adam")
    if adam is None:
        return None
    return tuple(_get(adam, name) for name in names)


def scale_block(optimizer: Any) -> int:
    """The elements of the flattened tensor that share one scale of the optimizer's 8-bit state."""
    return _get(optimizer, "block_size")


def stochastic_rounding(optimizer: Any) -> bool:
    """Whether the optimizer rounds bfloat16 weights stochastically (False for one without the field)."""
    return bool(getattr(optimizer, "bf16_stochastic_round", False))


def code_map(signed: bool) -> list[float]:
    """torchao's 8-bit code map for a signed moment (exp_avg) or an unsigned one (exp_avg_sq)."""
    from torchao.optim import subclass_8bit

    return _get(subclass_8bit, "get_qmap_signed" if signed else "get_qmap_unsigned")()


def state_8bit(codes: Any, scale: Any, qmap: Any, signed: bool, dtype: Any) -> Any:
    """torchao's 8-bit state tensor over `codes` (uint8), their block `scale` and the code map `qmap`, which it
    updates in place."""
    from torchao.optim import subclass_8bit

    return _get(subclass_8bit, "OptimState8bit")(codes, scale, qmap, signed, dtype=dtype)
