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


def finish_weight_grads(ctx, landed, world_size: int, first_index: int) -> list[torch.Tensor | None]:
    """Turn the summed accumulators that came home into DDP's mean, None where no grad is wanted."""
    grads = []
    for i in range(2):
        wanted = len(ctx.needs_input_grad) > first_index + i and ctx.needs_input_grad[first_index + i]
        if landed is None or i >= len(landed) or not wanted:
            grads.append(None)
        else:
            grads.append(landed[i].div_(world_size))
    return grads
