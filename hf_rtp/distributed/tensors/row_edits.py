"""Users' in-place edits of a rotated tensor through indexing: `w.data[-k:] = w.data[:-k].mean(0)` (transformers'
recipe for new tokens' rows), `lm_head.weight.data[7] = t`, `with torch.no_grad(): w[:5] = 0`.

In vanilla, indexing along dim 0 gives a view and an assignment lands in the tensor. DTensor gathers the indexed
rows of a Shard(0) tensor into a replicated copy instead, so the same assignment lands on that copy and the
parameter is unchanged, without a word; index_put_ and fill_ have no sharding strategy and fail raw.
RotatedTensor.__setitem__ comes here: each rank writes the selected rows it holds into its own chunk, with the
value's matching rows. Every rank assigns the same thing, as every DDP rank would (a value that is itself sharded
is gathered whole first, collectively). An in-place op on a gathered copy (`w.data[:5].zero_()`) is refused by
name instead (`refuse_write`): it could only change the copy.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from ...errors import RotatedStateError
from ...private.torch_names import local_tensor
from .sharding import chunk_rows

_HOW = (
    "Assign through the tensor itself, which writes the rows each rank holds: `w.data[rows] = value`, or "
    "`with torch.no_grad(): w[rows] = value`, with rows an int, a slice, a list or a 1-D tensor of row indices "
    "(columns may follow: `w.data[rows, :4] = value`); or edit a whole copy and write it back: "
    "`full = w.full_tensor(); ...; w.data.copy_(full)`"
)

COPY_WRITE_REFUSED = (
    "{op} on rows taken from a rotated tensor (`w.data[:5].zero_()`, `w[7].copy_(t)`): indexing a rotated tensor "
    "along its rows gathers them into a copy (each rank holds other rows of the tensor), so an in-place edit of "
    "that copy would leave the tensor unchanged, where vanilla's view would change it. " + _HOW
)


def assign(target: DTensor, key, value) -> None:
    """`target[key] = value` on a Shard(0) rotated tensor: each rank writes its own rows (module docstring)."""
    if torch.is_grad_enabled() and target.requires_grad:
        if target.grad_fn is None:  # vanilla's own error for a leaf
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        raise RotatedStateError(
            "an assignment into a rotated tensor that autograd records (the result of an op on a parameter) is not "
            "supported: each rank holds only its rows. Assign into the parameter under torch.no_grad(), or into "
            "param.data"
        )
    local = local_tensor(target)
    start, end = chunk_rows(target.shape[0], target.device_mesh.size(), target.device_mesh.get_local_rank())
    source = _plain(value, local)
    if _is_mask(key, target):
        _assign_masked(target, key, source, local, start, end)
        return
    rows, rest = _split(key, target)
    columns = torch.empty(target.shape[1:], device="meta")[rest].shape  # what the rest of the key selects
    if isinstance(rows, int):  # one row: no row dimension in the selection
        row = rows + target.shape[0] if rows < 0 else rows
        if not 0 <= row < target.shape[0]:
            raise IndexError(f"index {rows} is out of bounds for dimension 0 with size {target.shape[0]}")
        if start <= row < end:
            index = (row - start, *rest)
            local[index] = source.expand(columns)
        return
    selected = torch.arange(target.shape[0])[rows]  # global row indices, in the key's order (vanilla's checks)
    if selected.dim() != 1:
        raise RotatedStateError(f"indexing a rotated tensor's rows with a key of shape {tuple(rows.shape)}. {_HOW}")
    expanded = source.expand((selected.numel(), *columns))
    mine = ((selected >= start) & (selected < end)).nonzero().flatten()
    if mine.numel():
        index = (selected[mine] - start, *rest)
        local[index] = expanded[mine.to(expanded.device)]


def refuse_write(op: str) -> None:
    raise RotatedStateError(COPY_WRITE_REFUSED.format(op=op))


def _plain(value, local: torch.Tensor) -> torch.Tensor:
    """The value as a plain tensor in the chunk's dtype and device: a DTensor replicated everywhere is its local
    tensor; any other is gathered whole (collective: every rank assigns the same value)."""
    if isinstance(value, DTensor):
        replicated = all(isinstance(p, Replicate) for p in value.placements)
        value = local_tensor(value) if replicated else value.full_tensor()
    return torch.as_tensor(value).detach().to(device=local.device, dtype=local.dtype)


def _split(key, target: DTensor) -> tuple:
    """`key` as (what it selects of dim 0, the rest as a tuple of basic indices), Ellipsis spelled out."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is None for k in key):
        raise RotatedStateError(f"indexing a rotated tensor with None (a new axis) in an assignment. {_HOW}")
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = (*key[:at], *[slice(None)] * (target.dim() - len(key) + 1), *key[at + 1 :])
    if not key:
        key = (slice(None),)
    rows, rest = key[0], tuple(key[1:])
    if any(not isinstance(k, (int, slice)) or isinstance(k, bool) for k in rest):
        raise RotatedStateError(
            "indexing a rotated tensor with a tensor or list beyond its first dimension in an assignment. " + _HOW
        )
    if isinstance(rows, torch.Tensor) and rows.dim() == 0 and not rows.is_floating_point():
        rows = int(rows)
    if isinstance(rows, DTensor):
        raise RotatedStateError(f"indexing a rotated tensor's rows with a DTensor of indices. {_HOW}")
    if isinstance(rows, bool):
        raise RotatedStateError(f"indexing a rotated tensor with a bool. {_HOW}")
    if isinstance(rows, (list, tuple)):
        rows = torch.as_tensor(rows)
    if isinstance(rows, torch.Tensor):
        rows = rows.cpu()
    elif not isinstance(rows, (int, slice)):
        raise RotatedStateError(f"indexing a rotated tensor's rows with {type(rows).__name__}. {_HOW}")
    return rows, rest


def _is_mask(key, target: DTensor) -> bool:
    return isinstance(key, torch.Tensor) and key.dtype == torch.bool and key.shape == target.shape


def _assign_masked(target: DTensor, mask: torch.Tensor, source: torch.Tensor, local, start: int, end: int) -> None:
    """`target[mask] = value` with a mask of the target's shape (`w.data[w.data.abs() < eps] = 0`): a scalar value
    only, since a vector's entries are numbered over the whole mask."""
    if source.numel() != 1:
        raise RotatedStateError(
            "assigning a tensor of values through a boolean mask into a rotated tensor: the values are numbered "
            f"over the whole mask, which no rank holds. Assign a single value, or {_HOW}"
        )
    if isinstance(mask, DTensor):
        mask = mask.full_tensor() if any(not isinstance(p, Replicate) for p in mask.placements) else local_tensor(mask)
    local[mask[start:end].to(local.device)] = source.reshape(())
