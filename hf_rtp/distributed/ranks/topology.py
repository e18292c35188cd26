"""The rings of `rtp` ranks, from torchrun, accelerate or a single process.

Ranks form rings of `rtp_size` (default: all ranks, one flat ring). With smaller rings the ranks
are laid out as a 2-D ("dp", "rtp") grid: each row is one ring holding the whole model in 1/rtp_size
chunks (contiguous global ranks, so under torchrun a ring stays inside a node), and the rows are
data-parallel replicas of each other. A rotated parameter is a DTensor on its row's 1-D `rtp` mesh;
its gradient is summed by the ring and then averaged over the replicas of its column (Ring.replicas).
Every collective runs on hf_rtp's own groups (groups.py); calls every rank must make meet first
(rendezvous.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...errors import TopologyError
from ...settings import Settings
from ..tensors.rotated import RotationMesh
from ..transport.backends import transport_for
from ..transport.ring import WATCH_GRACE_S, Ring
from . import rendezvous
from .agreement import agreed
from .groups import group, init_world


@dataclass(frozen=True)
class Topology:
    rank: int
    """global rank"""
    world_size: int
    """all ranks, every replica"""
    device: torch.device
    mesh: RotationMesh | None
    """this rank's ring as a 1-D `rtp` mesh (rotated DTensors live on it); None for a ring of one"""
    ring: Ring
    control: dist.ProcessGroup | None
    """gloo over all ranks, hf_rtp's timeout: error agreement and small objects; None in one process"""
    entry: dist.ProcessGroup | None
    """gloo over all ranks, the short entry timeout: where collective calls meet"""
    entry_timeout: timedelta
    group: dist.ProcessGroup | None
    """all ranks, hf_rtp's timeout and the device's backend: replicated gradients are averaged here"""
    dp_rank: int
    """which replica (row of the grid) this rank belongs to"""
    dp_size: int
    """how many replicas (rows of the grid)"""
    processes: tuple[tuple[str, int], ...] = ()
    """(host, pid) of every rank, by global rank: where a rank that is gone can be looked up"""

    @property
    def rtp_rank(self) -> int:
        """This rank's place in its ring: which chunk of every rotated parameter it holds."""
        return self.ring.rank

    @property
    def rtp_size(self) -> int:
        """Ranks per ring: rotated parameters are cut into this many chunks."""
        return self.ring.size

    @property
    def is_writer(self) -> bool:
        """The one rank that writes a gathered checkpoint: ring rank 0 of the first replica."""
        return self.dp_rank == 0 and self.ring.rank == 0

    def enter(self, call: str, payload: Sequence[int] = ()) -> list[list[int]]:
        """Meet every other rank at the start of a collective `call`, or fail on every rank that came
        (rendezvous.enter); every rank's `payload`, in rank order."""
        return rendezvous.enter(
            call, self.entry, self.rank, self.world_size, self.entry_timeout, processes=self.processes, payload=payload
        )

    def same_settings(self, call: str, settings: dict[str, str]) -> None:
        """After `enter(call)`: every rank passed the same settings, or all fail naming the difference."""
        rendezvous.same_settings(call, settings, self.entry, self.world_size)


def setup(settings: Settings, device_mesh: DeviceMesh | None = None, rtp_size: int | None = None) -> Topology:
    """Join (or start) the process group the launcher describes and build the rings and their meshes."""
    device, timeout = settings.device, settings.timeout
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and launched > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_world(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if device_mesh is not None and not dist.is_initialized():
            raise TopologyError("a device_mesh was given but torch.distributed is not initialised")
        rings(device_mesh, rtp_size, 1)  # validates
        return _single(settings)

    world = dist.get_world_size()
    if "WORLD_SIZE" in os.environ and launched != world:
        raise TopologyError(
            f"the launcher says WORLD_SIZE={launched} but the initialised process group has {world} ranks; "
            "start every rank with the same launcher settings (torchrun --nproc_per_node, accelerate --num_processes)"
        )
    # the world's backend per device type: get_backend() says 'undefined' for a world started without a backend
    everyone, backend, rank = tuple(range(world)), dist.get_backend_config(), dist.get_rank()
    control = group("control", everyone, "gloo", timeout)
    with agreed(control, TopologyError):  # one rank's bad layout is everyone's error, not a hang
        rows = rings(device_mesh, rtp_size, world)
    processes = _agree_on_rings(rows, control)  # before any group of a ring: ranks asking for other groups would hang
    # Groups are made once per set of ranks, every rank making every group in one order (new_group is
    # collective over the world): per ring its own group for the ring (invariant I5 in DESIGN.md) and one
    # for its mesh; per column of the grid one to average rotated gradients over replicas; over everyone
    # one for replicated gradients and two small gloo ones for agreement and for meeting at entry.
    columns = [tuple(column) for column in zip(*rows, strict=True)]
    ring_timeout = timeout  # on NCCL the ring's watch names a lost rank first (distributed/transport/watch.py)
    if transport_for(backend, device.type) == "batched":
        ring_timeout += timedelta(seconds=2 * WATCH_GRACE_S)
    ring_groups = {row: group("ring", row, backend, ring_timeout) for row in rows if len(row) > 1}
    mesh_groups = {row: group("mesh", row, backend, timeout) for row in rows if len(row) > 1}
    replica_groups = {c: group("replicas", c, backend, timeout) for c in columns if len(c) > 1}
    ring_entries = {row: group("ring-entry", row, "gloo", settings.entry_timeout) for row in rows if len(row) > 1}
    world_group = group("mesh", everyone, backend, timeout)  # the flat ring's mesh group: same ranks, same group
    entry = group("entry", everyone, "gloo", settings.entry_timeout)
    dp_rank, row = next((i, row) for i, row in enumerate(rows) if rank in row)
    column = columns[row.index(rank)]
    replicas, replica_count = replica_groups.get(column), len(column)
    ring = Ring(
        ring_groups.get(row),
        settings.piece_bytes,
        replicas,
        replica_count,
        settings.reduce_dtype,
        device=device,
        timeout_s=timeout.total_seconds(),
    )
    ring.moves = settings.rotation_moves
    mesh = None
    if len(row) > 1:
        mesh = RotationMesh.of(
            mesh_groups[row], device.type, replicas, replica_count, ring_entries[row], settings.entry_timeout
        )
    return Topology(
        rank,
        world,
        device,
        mesh,
        ring,
        control,
        entry,
        settings.entry_timeout,
        world_group,
        dp_rank,
        len(rows),
        processes,
    )


def _single(settings: Settings) -> Topology:
    """One process: nothing rotates, nothing communicates."""
    ring = Ring(None, settings.piece_bytes)
    return Topology(0, 1, settings.device, None, ring, None, None, settings.entry_timeout, None, 0, 1)


def rings(device_mesh: DeviceMesh | None, rtp_size: int | None, world: int) -> list[tuple[int, ...]]:
    """The rings, as rows of global ranks: from `device_mesh` (1-D: one ring; 2-D ("dp", "rtp"): one ring
    per row), else `rtp_size` contiguous ranks each (default all ranks, one flat ring)."""
    if rtp_size is not None and (isinstance(rtp_size, bool) or not isinstance(rtp_size, int) or rtp_size < 1):
        raise TopologyError(f"rtp_size must be a positive number of ranks per ring, got {rtp_size!r}")
    if device_mesh is None:
        size = world if rtp_size is None else rtp_size
        if world % size:
            raise TopologyError(
                f"rtp_size={size} does not divide the {world} ranks: every ring must be whole. Pick a divisor of "
                f"the world size ({', '.join(str(k) for k in range(1, world + 1) if world % k == 0)})"
            )
        return [tuple(range(start, start + size)) for start in range(0, world, size)]
    if device_mesh.ndim == 1:
        rows = [tuple(device_mesh.mesh.tolist())]
        if len(rows[0]) != world:
            raise TopologyError(
                f"the device mesh has {device_mesh.size()} ranks but the process group has {world}; a 1-D mesh is one "
                "ring over every rank: pass a mesh over all ranks, a 2-D mesh named ('dp', 'rtp'), or rtp_size="
            )
    elif device_mesh.ndim == 2 and tuple(device_mesh.mesh_dim_names or ()) == ("dp", "rtp"):
        rows = [tuple(row) for row in device_mesh.mesh.tolist()]
    else:
        raise TopologyError(
            f"hf_rtp needs a 1-D mesh or a 2-D one with dims named ('dp', 'rtp'), got dims "
            f"{device_mesh.mesh_dim_names} of shape {tuple(device_mesh.mesh.shape)}"
        )
    if sorted(r for row in rows for r in row) != list(range(world)):
        raise TopologyError(f"the device mesh must hold every one of the {world} ranks exactly once, got {rows}")
    if rtp_size is not None and rtp_size != len(rows[0]):
        raise TopologyError(f"rtp_size={rtp_size} contradicts the device mesh, whose rings have {len(rows[0])} ranks")
    return rows


def _agree_on_rings(rows: list[tuple[int, ...]], control: dist.ProcessGroup) -> tuple[tuple[str, int], ...]:
    """Every rank asked for the same rings; returns every rank's (host, pid), gathered in the same call."""
    everyone: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, (rows, socket.gethostname(), os.getpid()), group=control)
    except RuntimeError as err:
        raise TopologyError(
            f"rank {dist.get_rank()} could not agree on the rings with the other ranks "
            f"({str(err).splitlines()[0][:200]}): "
            "every rank must call from_pretrained"
        ) from err
    if any(theirs != rows for theirs, _, _ in everyone):
        layouts = sorted({str([len(r) for r in theirs]) for theirs, _, _ in everyone})
        raise TopologyError(
            f"ranks asked for different rings ({', '.join(layouts)} ranks per ring): pass the same rtp_size or "
            "device_mesh on every rank"
        )
    return tuple((host, pid) for _, host, pid in everyone)
