"""Data-parallel glue: averaging the gradients of replicated parameters, and keeping DDP off rotated ones."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..private.torch_names import DDP_IGNORE_ATTRIBUTE, flatten_dense_tensors, unflatten_dense_tensors
from .state import state_of


class _RotatedNames:
    """The names of `module`'s rotated parameters, listed when DDP reads them rather than when hf_rtp
    loaded the model: PEFT renames the layers it wraps (`q_proj.weight` -> `q_proj.base_layer.weight`).
    DDP reads the list from the module it wraps, through PEFT's attribute forwarding when that is a
    PeftModel, and matches names relative to it: each name is also listed under PEFT's prefix."""

    PREFIXES = ("", "base_model.model.")

    def __init__(self, module: nn.Module, on_read: Callable[[], None] | None = None):
        self.module, self.on_read = module, on_read

    def __iter__(self):
        if self.on_read is not None:  # who is wrapping the model (binding.bind: a plain Accelerator's prepare)
            self.on_read()
        names = [n for n, p in self.module.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
        return iter([prefix + name for prefix in self.PREFIXES for name in names])


def ignore_rotated_in_ddp(module: nn.Module, on_read: Callable[[], None] | None = None) -> None:
    """Tell DDP (so accelerate, Trainer and TRL too) to leave rotated parameters alone: the ring reduces them.

    from_pretrained does this for the model it returns, so a PEFT model around it needs no call either.
    `on_read` runs each time DDP reads the list, while it wraps the model.
    """
    setattr(module, DDP_IGNORE_ATTRIBUTE, _RotatedNames(module, on_read))


def sync_grads(model: nn.Module) -> None:
    """Average replicated parameters' gradients over all ranks, as DDP would, in one all-reduce per dtype.

    Rotated parameters already hold the mean (the ring, and on a 2-D grid the replicas, reduced them). Call it after
    backward in a
    plain loop; under DDP or `accelerator.prepare` the wrapper does this instead, so do not call both.
    """
    state = state_of(model, required=False)
    if state is None or state.topology.world_size == 1:
        return
    topology = state.topology
    grads = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = flatten_dense_tensors(group)
        dist.all_reduce(flat, group=topology.group)
        flat.div_(topology.world_size)
        for g, synced in zip(group, unflatten_dense_tensors(flat, group), strict=True):
            g.copy_(synced)
