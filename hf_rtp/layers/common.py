"""Small pieces every rotated layer shares."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(param: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's chunk, still connected to autograd so its gradient lands on the DTensor."""
    if param is None:
        return None
    return param.to_local() if isinstance(param, DTensor) else param


def own_bundle(weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    return [weight] if bias is None else [weight, bias]


def finish_weight_grads(ctx, landed, world_size: int) -> list[torch.Tensor | None]:
    """Turn the summed accumulators that came home into DDP's mean: [weight grad, bias grad].

    Every rotated Function takes its weight as input 1 and its bias, if any, as input 2; a grad
    is None where that input wants none (frozen, absent).
    """
    grads = []
    for i, wanted in enumerate(ctx.needs_input_grad[1:3]):
        grads.append(landed[i].div_(world_size) if landed is not None and i < len(landed) and wanted else None)
    return grads
