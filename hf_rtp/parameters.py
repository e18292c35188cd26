"""Rotated parameters: Shard(0) DTensors with data-parallel semantics.

DTensor's autograd assumes SPMD, every rank computing on the same data: the backward of
`full_tensor()` (a redistribute to Replicate) merely slices the incoming gradient, so a rank's
chunk would receive only its own batch's gradient. Under RTP each rank has its own batch, so the
gradient of a gathered rotated weight must be the mean over ranks, as DDP's is. This class gives
`full_tensor()` exactly that backward (sum over all ranks, then this rank's rows, divided by their
number; on a 2-D grid the sum runs over the ring, then over the replicas of this rank's rows) and
refuses the other redistributions under autograd, where there is no data-parallel answer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .errors import RotatedStateError
from .sharding import chunk_rows


_WRITE_REFUSED = (
    "refusing to write a rotated tensor as a whole tensor: this rank holds only its own rows. Save weights with "
    "model.save_pretrained(dir) on every rank (or hf_rtp.Accelerator().save_model), training state with "
    "hf_rtp.Accelerator().save_state or hf_rtp.save_training_state(dir, model, optimizer, ...)."
)


class _DataParallelGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.stride = param.device_mesh, param.shape, param.stride()
        return DTensor.full_tensor(DTensor.detach(param))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mesh = ctx.mesh
        group = mesh.get_group()
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)  # the sum over the ring's batches
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        start, end = chunk_rows(ctx.shape[0], world, rank)
        local = grad[start:end].contiguous()
        replicas = getattr(mesh, "replicas", None)  # on a 2-D grid: and over the other replicas' batches
        if replicas is not None:
            dist.all_reduce(local, group=replicas)
        local.div_(world * getattr(mesh, "replica_count", 1))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=ctx.shape, stride=ctx.stride)


class RotatedTensor(DTensor):
    """The class of a rotated model's rotated parameters (nn.Parameters like any other) and of their
    detached aliases (state dicts)."""

    __slots__ = ()

    # nn.Parameter(t) and Module._apply need detach(), copy.deepcopy needs clone(), to keep the class
    def detach(self) -> "RotatedTensor":
        return _marked(DTensor.detach(self))

    def clone(self, *args, **kwargs) -> "RotatedTensor":
        return _marked(DTensor.clone(self, *args, **kwargs))

    def untyped_storage(self):
        # what safetensors (accelerate's default save_state, save_model, save_file) reads first
        raise RotatedStateError(_WRITE_REFUSED)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank (collective). Under autograd its gradient reaches each
        rank's chunk as the mean over all ranks' batches, as DDP's would."""
        if torch.is_grad_enabled() and self.requires_grad:
            if grad_placements is not None:
                raise RotatedStateError("full_tensor(grad_placements=...) is not supported on a rotated parameter")
            return _DataParallelGather.apply(self)
        return DTensor.full_tensor(DTensor.detach(self))

    def redistribute(self, device_mesh=None, placements=None, **kwargs) -> DTensor:
        if torch.is_grad_enabled() and self.requires_grad:
            raise RotatedStateError(
                "redistribute() on a rotated parameter under autograd would give each rank the gradient of its own "
                "batch only (DTensor assumes every rank has the same data). Use param.full_tensor(), whose gradient "
                "hf_rtp averages over ranks like DDP, or call it under torch.no_grad()."
            )
        return DTensor.redistribute(DTensor.detach(self), device_mesh, placements, **kwargs)


def _marked(tensor: DTensor) -> RotatedTensor:
    tensor.__class__ = RotatedTensor  # same layout as DTensor; dispatch and nn.Parameter checks unchanged
    return tensor


def make_rotated(param: torch.nn.Parameter) -> torch.nn.Parameter:
    return _marked(param)


def keep_rotated(module: torch.nn.Module) -> None:
    """Mark again what `module.to()` / `.float()` unmarked: nn.Module._apply swaps a DTensor parameter
    with a plain DTensor copy (torch.utils.swap_tensors swaps the class too). Without this a Trainer's
    `model.to(device)` would silently restore DTensor's SPMD gradient for full_tensor()."""
    from .mesh import RotationMesh

    for param in module.parameters():
        if type(param) is DTensor and isinstance(param.device_mesh, RotationMesh):
            make_rotated(param)
