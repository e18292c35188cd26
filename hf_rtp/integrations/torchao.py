"""torchao's low-bit optimizers (`torchao.optim.AdamW8bit`, `AdamW4bit`, `AdamWFp8`, ...) over rotated parameters:
refused by name, before any state exists.

They compile each parameter's step with torch.compile, which cannot trace hf_rtp's rotated tensors, and they
size their quantized state by each rank's own rows (as under FSDP2): a rank's short chunk of a large tensor
would get float32 state where vanilla's whole tensor gets 8-bit, so even a step that ran would not be
vanilla's. bitsandbytes' 8-bit optimizers step rotated rows exactly (integrations/bitsandbytes.py).
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..distributed.rotated import RotatedTensor
from ..errors import RotatedStateError

_HOOK: list = []


def refuse_low_bit_optimizers() -> None:
    """Once per process, on the first rotated load: a step pre-hook that returns at once for any optimizer that is
    not torchao's or holds no rotated parameter (DESIGN.md, "Patches")."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer, args, kwargs) -> None:
    if not type(optimizer).__module__.startswith("torchao."):
        return
    if any(isinstance(p, RotatedTensor) for group in optimizer.param_groups for p in group["params"]):
        raise RotatedStateError(
            f"torchao's {type(optimizer).__name__} over a rotated model: it compiles each parameter's step, which "
            "torch.compile cannot trace on hf_rtp's rotated tensors, and sizes its low-bit state by each rank's rows, "
            "not the whole tensor as vanilla does. Use bitsandbytes' AdamW8bit (Trainer: optim='adamw_bnb_8bit'), "
            "whose 8-bit state hf_rtp steps on each rank's rows exactly, or torch.optim.AdamW"
        )
