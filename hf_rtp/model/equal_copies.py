"""Every rank's copy of a replicated parameter is one value, as DDP makes it.

DDP broadcasts rank 0's parameters when it wraps a model, so a script that seeds each rank differently
(`set_seed(seed, device_specific=True)`, as accelerate's examples do) before `get_peft_model` still trains one set of
adapters. hf_rtp reads replicated parameters from the checkpoint alike on every rank; those added after load
(adapters, a prompt encoder, a new head) are made rank 0's at the first forward with autograd on that sees them
(`make_equal`, from step_check.watch), before they are used. Copies that differ when sync_grads first averages
their gradients (changed on each rank differently since) are refused by name (`refuse_different`): their
gradients were taken at different points, and no mean of them is DDP's.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import log
from ..errors import CollectiveMisuseError, RotatedStateError
from ..private.torch_names import flatten_dense_tensors, unflatten_dense_tensors

_CHECKED = WeakIdKeyDictionary()
"""parameter -> None: its copies were made equal, or found equal, on every rank"""


def make_equal(module: nn.Module, params: list[nn.Parameter], topology) -> None:
    """Collective: `params` (of `module`, first seen at this forward) become global rank 0's on every rank."""
    if topology.world_size == 1:
        return
    names = _names(module, params)
    digest = zlib.crc32(";".join(f"{n}:{tuple(p.shape)}" for n, p in zip(names, params, strict=True)).encode())
    everyone = topology.enter("a forward's new replicated parameters", payload=[len(params), digest & 0x7FFFFFFF])
    if any(row[:2] != everyone[0][:2] for row in everyone):
        raise CollectiveMisuseError(
            "ranks added different replicated parameters before this forward ("
            + ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(everyone))
            + f"; this rank's: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}). Every rank must build the "
            "same model: add adapters and heads on every rank alike"
        )
    changed = []  # on the device: read once, below, in host memory
    with torch.no_grad():
        for group in _by_kind(params):
            flat = flatten_dense_tensors([p.detach() for p in group])
            before = flat.clone()
            dist.broadcast(flat, src=0, group=topology.group)
            changed.append((flat != before).any())
            for p, value in zip(group, unflatten_dense_tensors(flat, group), strict=True):
                p.copy_(value)
    for p in params:
        _CHECKED[p] = None
    if _any_rank(torch.stack(changed), topology):
        log.warning(
            f"{len(params)} replicated parameter(s) added after load ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) differed across ranks (initialised under a different seed on "
            "each rank?); every rank now holds rank 0's, as DDP makes them when it wraps a model"
        )


def unchecked(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if p not in _CHECKED]


def refuse_different(module: nn.Module, params: list[nn.Parameter], topology) -> None:
    """Collective, inside sync_grads (after its meeting): `params`, never compared yet, are equal on every rank, or
    every rank raises naming those that differ."""
    if not params:
        return
    differs = []  # per parameter, on the device: one copy to the host below, once in a parameter's life
    with torch.no_grad():
        for group in _by_kind(params):
            flat = flatten_dense_tensors([p.detach() for p in group])
            most = flat.clone()
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=topology.group)
            for mine, top in zip(unflatten_dense_tensors(flat, group), unflatten_dense_tensors(most, group),
                                 strict=True):  # fmt: skip
                differs.append((mine != top).any())
    order = [p for group in _by_kind(params) for p in group]
    flags = torch.stack(differs).to(torch.int64).cpu()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topology.control)
    if int(flags.sum()) == 0:
        for p in params:
            _CHECKED[p] = None
        return
    names = [n for n, flag in zip(_names(module, order), flags.tolist(), strict=True) if flag]
    raise RotatedStateError(
        f"sync_grads: {len(names)} replicated parameter(s) hold different values on different ranks "
        f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), so their gradients were taken at different "
        "points and no mean of them is DDP's. They were changed on each rank differently after the model was loaded "
        "(an initialisation under a per-rank seed, such as set_seed(seed, device_specific=True)?). Make them equal "
        "before the first forward: initialise them under one seed on every rank, or give every rank rank 0's "
        "(torch.distributed.broadcast(p.data, src=0) for each), as DDP does when it wraps a model. Nothing was averaged"
    )


def _any_rank(flags: torch.Tensor, topology) -> bool:
    found = flags.to(torch.int64).max().reshape(1).cpu()
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=topology.control)
    return bool(found.item())


def _by_kind(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    kinds: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.values())


def _names(module: nn.Module, params: list[nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    return [by_id.get(id(p), "?") for p in params]
