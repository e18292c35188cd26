"""Optimizer state quantized in blocks of the flattened tensor (bitsandbytes' and torchao's 8-bit optimizers), on
rotated rows.

bitsandbytes (like torchao, integrations/torchao.py, with its own `block_size`) keeps an 8-bit optimizer's moments
as uint8 codes in the parameter's shape, plus one float32 scale (`absmax`) per BLOCK consecutive elements of the
flattened tensor, and its update of a block reads nothing outside that block. So a rank that steps only its own rows
computes, bit for bit, what a step of the whole tensor computes there, provided every rank's rows start on a block
boundary: then every block is one rank's alone. Where they do not, a block would straddle two ranks; hf_rtp then
keeps that tensor's state in float32 (`aligned` says which; integrations/bitsandbytes.py warns), never a silently
different step.

The scales are a rotated tensor too, cut by the I2 rule: k rows of the parameter hold m whole blocks
(k = BLOCK / gcd(C, BLOCK), m = C / gcd(C, BLOCK), C the elements per row), so the scales have the shape
(ceil(rows / k), m) and rank r's rows of it are exactly its blocks whenever its rows are aligned. That
shape does not depend on the world size: a training state saved by N ranks loads on M like every other
rotated tensor.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from ...errors import RotatedStateError
from ...private.torch_names import local_tensor, op_schema
from .sharding import chunk_rows

BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer state (Optimizer1State/Optimizer2State.init_state)
STEPPED = ("optimizer_update_8bit_blockwise", "optimizer_update_32bit")
"""bitsandbytes' update ops that run on this rank's rows: every element (or block) updated from itself alone"""

_REFUSED = (
    "bitsandbytes' {op} on a rotated parameter: {why}. hf_rtp steps bitsandbytes' Adam, AdamW, Lion, SGD, RMSprop "
    "and Adagrad (8-bit blockwise, paged or 32-bit state) on each rank's rows; use one of those, or torch.optim.AdamW"
)


def scales_shape(shape: torch.Size | tuple[int, ...], block: int = BLOCK) -> tuple[int, int]:
    """The global shape of a parameter's block scales as hf_rtp keeps them: (ceil(rows / k), m), see above."""
    rows, per_row = shape[0], math.prod(shape[1:])
    common = math.gcd(per_row, block)
    k, m = block // common, per_row // common
    return math.ceil(rows / k), m


def aligned(shape: torch.Size | tuple[int, ...], world: int, block: int = BLOCK) -> bool:
    """Whether every rank's rows of a tensor of `shape` start on a block of the flattened tensor, and its rows
    of the scales (cut by I2) are exactly its blocks. The same answer on every rank."""
    rows, per_row = shape[0], math.prod(shape[1:])
    if per_row == 0:
        return False
    k = block // math.gcd(per_row, block)
    scale_rows = scales_shape(shape, block)[0]
    for rank in range(world):
        start, end = chunk_rows(rows, world, rank)
        lo, hi = chunk_rows(scale_rows, world, rank)
        if start == end:
            if lo != hi:
                return False
        elif start % k or (lo, hi) != (start // k, math.ceil(end / k)):
            return False
    return True


def zero_scales(param: DTensor, block: int = BLOCK) -> DTensor:
    """Zeros for the block scales of a rotated parameter: this rank's rows of (ceil(rows / k), m), rotated."""
    mesh = param.device_mesh
    shape = scales_shape(param.shape, block)
    start, end = chunk_rows(shape[0], mesh.size(), mesh.get_local_rank())
    local = torch.zeros((end - start, shape[1]), dtype=torch.float32, device=local_tensor(param).device)
    scales = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))
    return scales


def step_rows(func, args: tuple, kwargs: dict) -> None:
    """Run one of bitsandbytes' update ops (STEPPED) on this rank's rows: the parameter, its gradient and
    state as local tensors, the scales as this rank's blocks. Anything else is refused by name."""
    schema = op_schema(func)
    op = schema.name.split("::")[-1]
    if op not in STEPPED:
        raise RotatedStateError(_REFUSED.format(op=op, why="hf_rtp does not run this op on rows"))
    names = [a.name for a in schema.arguments]
    bound = dict(zip(names[: len(args)], args, strict=True))
    bound.update(kwargs)
    if bound.get("max_unorm", 0.0) > 0.0:
        raise RotatedStateError(
            _REFUSED.format(op=op, why="max_unorm (LAMB, LARS) bounds the update by the whole tensor's norm")
        )
    param = bound["p"]
    if not isinstance(param, DTensor):
        raise RotatedStateError(_REFUSED.format(op=op, why="its state is rotated but the parameter is not"))
    blocks = math.ceil(local_tensor(param).numel() / BLOCK)
    for name, value in bound.items():
        if name.startswith("absmax") and value is not None:
            if not isinstance(value, DTensor) or tuple(value.shape) != scales_shape(param.shape):
                raise RotatedStateError(
                    _REFUSED.format(
                        op=op,
                        why="its 8-bit state was made outside hf_rtp's step (the block scales are whole, not this "
                        "rank's blocks); let optimizer.step() create it, or load it with hf_rtp.load_training_state",
                    )
                )
            bound[name] = local_tensor(value).view(-1)[:blocks]
        elif isinstance(value, DTensor):
            bound[name] = local_tensor(value)
    func(*(bound[name] for name in names if name in bound))
