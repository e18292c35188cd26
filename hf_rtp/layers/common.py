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


def finish_weight_grads(ctx, landed, world_size: int, positions=(1, 2)) -> list[torch.Tensor | None]:
    """Turn the summed accumulators that came home into DDP's mean, one per rotated input.

    `positions` are the Function inputs the accumulators belong to (weight 1 and bias 2 for most
    ops); a grad is None where that input wants none (frozen, absent).
    """
    return [
        landed[i].div_(world_size) if landed is not None and i < len(landed) and ctx.needs_input_grad[p] else None
        for i, p in enumerate(positions)
    ]
