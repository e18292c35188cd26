"""Process groups and the 1-D `rtp` device mesh, from torchrun, accelerate or a single process."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .ring import Ring

DEFAULT_TIMEOUT = timedelta(minutes=10)
_ring_groups: dict[tuple, dist.ProcessGroup] = {}


class TopologyError(RuntimeError):
    """The launch environment, the process group and the mesh disagree."""


@dataclass
class Topology:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None
    ring: Ring

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group replicated gradients and gathers use (the mesh's); None at world size 1."""
        return None if self.mesh is None else self.mesh.get_group()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Default: this process's GPU (LOCAL_RANK) when CUDA is present, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        seconds = os.environ.get("HF_RTP_TIMEOUT")
        return timedelta(seconds=float(seconds)) if seconds else DEFAULT_TIMEOUT
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def setup(
    device: str | torch.device | None = None,
    device_mesh: DeviceMesh | None = None,
    timeout: float | timedelta | None = None,
) -> Topology:
    """Join (or start) the process group the launcher describes and build the `rtp` mesh and ring.

    Every collective hf_rtp starts waits at most `timeout` (default 10 minutes, or HF_RTP_TIMEOUT
    seconds), so a dead rank ends in an error, never a hang.
    """
    device = resolve_device(device)
    timeout = _as_timedelta(timeout)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and launched > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    if not dist.is_initialized():
        if device_mesh is not None:
            raise TopologyError("a device_mesh was given but torch.distributed is not initialised")
        return Topology(0, 1, device, None, Ring(None))

    world = dist.get_world_size()
    if "WORLD_SIZE" in os.environ and launched != world:
        raise TopologyError(
            f"the launcher says WORLD_SIZE={launched} but the initialised process group has {world} ranks; "
            "start every rank with the same launcher settings (torchrun --nproc_per_node, accelerate --num_processes)"
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise TopologyError(f"hf_rtp needs a 1-D device mesh, got one with dims {device_mesh.mesh_dim_names}")
        if device_mesh.size() != world:
            raise TopologyError(
                f"the device mesh has {device_mesh.size()} ranks but the process group has {world}; "
                "hf_rtp rotates across every rank: pass a mesh over all ranks, or none"
            )
    if world == 1:
        return Topology(0, 1, device, None, Ring(None))
    mesh = device_mesh or init_device_mesh(device.type, (world,), mesh_dim_names=("rtp",))
    return Topology(dist.get_rank(), world, device, mesh, Ring(_ring_group(mesh, timeout)))


def _ring_group(mesh: DeviceMesh, timeout: timedelta) -> dist.ProcessGroup:
    """A group of rotation's own (I5), made once per set of ranks: new_group is itself collective."""
    ranks = tuple(mesh.mesh.flatten().tolist())
    backend = dist.get_backend(mesh.get_group())
    key = (ranks, backend, id(dist.group.WORLD))
    if key not in _ring_groups:
        if not _ring_groups:
            atexit.register(_destroy_ring_groups)
        _ring_groups[key] = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
    return _ring_groups[key]


def _destroy_ring_groups() -> None:
    """Tear rotation's groups down while the world group still exists: left to interpreter shutdown,
    a gloo group can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        for group in _ring_groups.values():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the user destroyed everything already
                pass
    _ring_groups.clear()


def raise_if_any_failed(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Make a failure on one rank an error on every rank, instead of a hang in the next collective."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"rank {rank} failed: {message}")
