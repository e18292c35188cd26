"""Data-parallel glue: averaging the gradients of replicated parameters (`sync_grads`), and keeping DDP off rotated
ones in whatever module holds the rotated model.

Rotated parameters (DTensors) get the mean over every rank's batch from the ring itself. Replicated ones (norms,
routers, summed-partial biases, LoRA adapters, a PEFT prompt encoder, a wrapper's own layers) hold each rank's own
gradient until DDP, `accelerator.prepare` or `sync_grads` averages it (DESIGN.md I4); step_check.py refuses a step
over one that nothing averaged.

DDP reads the names to leave alone from the module it wraps (`_ddp_params_and_buffers_to_ignore`), relative to
that module. A rotated model carries its list from load; any module it becomes part of (a PeftModel, TRL's or a
user's wrapper, an nn.Sequential) gets its own as it takes the model in, through torch's module registration hook
(`watch_holders`), so `DDP(anything holding the model)` ignores the rotated parameters whatever their prefix.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_module_registration_hook

from ..errors import CollectiveMisuseError
from ..private.torch_names import DDP_IGNORE_ATTRIBUTE, flatten_dense_tensors, unflatten_dense_tensors
from . import equal_copies, step_check
from .state import ATTRIBUTE, RTPState, find_rotated


class _RotatedNames:
    """The names of `module`'s rotated parameters, listed when DDP reads them rather than when the attribute was
    set: PEFT renames the layers it wraps (`q_proj.weight` -> `q_proj.base_layer.weight`). DDP reading them is
    DDP wrapping `module`: from then on it averages every gradient of `module` (step_check.averaged_by_ddp)."""

    def __init__(self, module: nn.Module, on_read: Callable[[], None] | None = None, own: tuple = ()):
        self.module, self.on_read, self.own = module, on_read, own
        """`on_read` runs each time DDP reads the list (binding.bind: adopt a plain Accelerator's prepare); `own`,
        the names the module's own attribute listed before hf_rtp's took its place"""

    def __iter__(self):
        step_check.averaged_by_ddp(self.module)
        for inner in self.module.modules():  # the rotated models inside: who is wrapping them
            names = inner.__dict__.get(DDP_IGNORE_ATTRIBUTE)
            if isinstance(names, _RotatedNames) and names.on_read is not None:
                names.on_read()
        names = [n for n, p in self.module.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
        return iter([*self.own, *names])


def ignore_rotated_in_ddp(module: nn.Module, on_read: Callable[[], None] | None = None) -> None:
    """Tell DDP (so accelerate, Trainer and TRL too) to leave `module`'s rotated parameters alone: the ring
    reduces them.

    from_pretrained does this for the model it returns, and every module that takes it in (a PeftModel, a
    wrapper) gets the same as it does, so no call is needed. `on_read` runs each time DDP reads the list."""
    module.__dict__[DDP_IGNORE_ATTRIBUTE] = _RotatedNames(module, on_read)


_HOOK: list = []


def watch_holders() -> None:
    """Once per process, at the first load at world size > 1: torch's module registration hook (`_taken_in`), which
    returns at once for any module that holds no rotated model (DESIGN.md, "Patches")."""
    if not _HOOK:
        _HOOK.append(register_module_module_registration_hook(_taken_in))


def _taken_in(parent: nn.Module, name: str, submodule) -> None:
    """`parent` takes in `submodule`: when that holds a rotated model, `parent` gets its own ignore list (its own
    names kept), and its trainable replicated parameters are watched like the model's (step_check.watch)."""
    names = submodule.__dict__.get(DDP_IGNORE_ATTRIBUTE) if isinstance(submodule, nn.Module) else None
    if not isinstance(names, _RotatedNames):
        return None
    current = parent.__dict__.get(DDP_IGNORE_ATTRIBUTE, getattr(type(parent), DDP_IGNORE_ATTRIBUTE, None))
    if isinstance(current, _RotatedNames):
        return None
    parent.__dict__[DDP_IGNORE_ATTRIBUTE] = _RotatedNames(parent, own=tuple(current or ()))
    model = find_rotated(submodule)
    if model is not None:
        state: RTPState = model.__dict__[ATTRIBUTE]
        step_check.watch(parent, parent, state.topology)
    return None


def sync_grads(model: nn.Module) -> None:
    """Average replicated parameters' gradients over all ranks, as DDP would, in one all-reduce per dtype.

    Collective: every rank calls it, or those that did fail naming it. Rotated parameters already hold the mean
    (the ring, and on a 2-D grid the replicas, reduced them). Call it after backward in a plain loop (after the last
    micro-batch's, when accumulating); under DDP or `accelerator.prepare` the wrapper does this instead, so do not
    call both. A parameter whose gradient some ranks lack (a branch their batch never reached) is averaged with zeros
    there, as DDP with find_unused_parameters=True does. At world size > 1, an optimizer step over replicated
    gradients that a backward made and neither this nor DDP averaged is refused (model/step_check.py).
    """
    found = find_rotated(model)
    if found is None or found.__dict__[ATTRIBUTE].topology.world_size == 1:
        return
    topology = found.__dict__[ATTRIBUTE].topology
    params = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
    held = [p.grad is not None for p in params]
    unchecked = equal_copies.unchecked(params)
    shapes = zlib.crc32(";".join(str(tuple(p.shape)) for p in params).encode()) & 0x7FFFFFFF
    everyone = topology.enter("sync_grads", payload=[len(params), shapes, sum(held), len(unchecked)])
    if any(row[0] != everyone[0][0] or row[1] != everyone[0][1] or row[3] != everyone[0][3] for row in everyone):
        raise CollectiveMisuseError(
            "sync_grads: ranks hold different sets of trainable replicated parameters ("
            + ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(everyone))
            + "). Every rank must build the same model and call sync_grads on it"
        )
    if any(row[2] != len(params) for row in everyone):  # some rank lacks some gradient: which, on every rank
        used = torch.tensor(held, dtype=torch.int64)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=topology.control)
        for p, anywhere in zip(params, used.tolist(), strict=True):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
        params = [p for p, anywhere in zip(params, used.tolist(), strict=True) if anywhere]
    equal_copies.refuse_different(model, equal_copies.unchecked(params), topology)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for group in by_dtype.values():
        flat = flatten_dense_tensors(group)
        dist.all_reduce(flat, group=topology.group)
        flat.div_(topology.world_size)
        for g, synced in zip(group, unflatten_dense_tensors(flat, group), strict=True):
            g.copy_(synced)
    step_check.averaged(params)
