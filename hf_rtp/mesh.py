"""Process groups and the `rtp` rings, from torchrun, accelerate or a single process.

Ranks form rings of `rtp_size` (default: all ranks, one flat ring). With smaller rings the ranks
are laid out as a 2-D ("dp", "rtp") grid: each row is one ring holding the whole model in 1/rtp_size
chunks (contiguous global ranks, so under torchrun a ring stays inside a node), and the rows are
data-parallel replicas of each other. A rotated parameter is a DTensor on its row's 1-D `rtp` mesh;
its gradient is summed by the ring and then averaged over the replicas of its column (Ring.replicas).

hf_rtp never communicates on the world group: whoever made that (accelerate and Trainer give it
30 minutes), every collective hf_rtp issues runs on a group of its own that carries hf_rtp's
timeout (`timeout=` or HF_RTP_TIMEOUT, default 10 minutes). Calls every rank must make first meet
on a small gloo group with a short timeout (HF_RTP_ENTRY_TIMEOUT, default 60 s), so a rank that
skips one is an error within a minute on every rank that entered, never a silent wait.
"""

from __future__ import annotations

import atexit
import os
import re
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .errors import CLASSES, CollectiveMisuseError, HfRtpError, RotatedStateError, TopologyError
from .ring import Ring

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_ENTRY_TIMEOUT = timedelta(seconds=60)
_groups: dict[tuple, dist.ProcessGroup] = {}

_PICKLE_REFUSED = (
    "refusing to pickle a rotated tensor: each rank holds other rows (and other data), so a pickled state "
    "dict written by one rank would silently hold that rank's slice. Save weights with "
    "model.save_pretrained(dir) on every rank, training state with hf_rtp.save_training_state(dir, model, "
    "optimizer, ...), or train through accelerator.save_state / hf_rtp.Trainer, which hf_rtp makes collective."
)


class RotationMesh(DeviceMesh):
    """The mesh of rotated parameters. Every DTensor derived from one (detached copies, gradients,
    optimizer moments) keeps this mesh, so this is where pickling them is refused: torch.save of a
    state dict, accelerate's and Trainer's pickle-based saves."""

    def __reduce_ex__(self, protocol):
        raise RotatedStateError(_PICKLE_REFUSED)

    def __deepcopy__(self, memo):
        return self  # a handle on process groups, not data: copies of rotated tensors share it


@dataclass
class Topology:
    rank: int
    """global rank"""
    world_size: int
    """all ranks, every replica"""
    device: torch.device
    mesh: DeviceMesh | None
    """this rank's ring as a 1-D `rtp` mesh (rotated DTensors live on it); None for a ring of one"""
    ring: Ring
    control: dist.ProcessGroup | None = None
    """gloo over all ranks, hf_rtp's timeout: error agreement and small objects"""
    entry: dist.ProcessGroup | None = None
    """gloo over all ranks, the short entry timeout: where collective calls meet"""
    entry_timeout: timedelta = DEFAULT_ENTRY_TIMEOUT
    group: dist.ProcessGroup | None = None
    """all ranks, hf_rtp's timeout and the device's backend: replicated gradients are averaged here"""
    dp_rank: int = 0
    """which replica (row of the grid) this rank belongs to"""
    dp_size: int = 1

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

    def enter(self, call: str) -> None:
        """Meet every other rank at the start of a collective `call`, or fail on every rank that came.

        Fails within the entry timeout when a rank never comes, and at once when ranks arrive in
        different calls (one saving while another runs a forward).
        """
        if self.world_size == 1:
            return
        mine = torch.tensor([zlib.crc32(call.encode())], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(everyone, mine, group=self.entry)
        except RuntimeError as err:
            raise CollectiveMisuseError(
                f"{call} is collective: every rank must call it, but rank {self.rank} waited "
                f"{self.entry_timeout.total_seconds():g} s (HF_RTP_ENTRY_TIMEOUT) and not every rank came. "
                f"Call {call} on every rank (not under `if accelerator.is_main_process:`), and give every rank "
                "the same number of batches."
            ) from err
        calls = {int(t) for t in everyone}
        if len(calls) > 1:
            _CALLS.setdefault(int(mine), call)
            names = [_CALLS.get(int(t), "another hf_rtp call") for t in everyone]
            raise CollectiveMisuseError(
                "ranks entered different collective calls at once: "
                + ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
                + ". Every rank must make the same calls in the same order."
            )


_CALLS = {zlib.crc32(c.encode()): c for c in ("forward", "generate", "save_pretrained", "push_to_hub")}


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


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400.0


def as_timedelta(value: float | timedelta | None, variable: str, default: timedelta) -> timedelta:
    """`value`, else the environment variable, else `default`. Seconds, or with a unit: "90s", "10m", "1h", "2d".

    Between 1 second (less cannot even open a connection between ranks) and 7 days (more overflows
    the process group's clock, and is a hang in all but name); anything else names the setting."""
    if value is None:
        value = os.environ.get(variable) or None
        if value is None:
            return default
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", str(value).lower())
        seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)] if match else float("nan")
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise TopologyError(
            f"{variable}{' (or timeout=)' if variable == 'HF_RTP_TIMEOUT' else ''} must be a duration from 1 second to 7 days: seconds like 600, or 90s, 10m, 1h, "
            f"2d; got {value!r}"
        )
    return timedelta(seconds=seconds)


def setup(
    device: str | torch.device | None = None,
    device_mesh: DeviceMesh | None = None,
    timeout: float | timedelta | None = None,
    rtp_size: int | None = None,
) -> Topology:
    """Join (or start) the process group the launcher describes and build the rings and their meshes."""
    device = resolve_device(device)
    timeout = as_timedelta(timeout, "HF_RTP_TIMEOUT", DEFAULT_TIMEOUT)
    entry_timeout = as_timedelta(None, "HF_RTP_ENTRY_TIMEOUT", DEFAULT_ENTRY_TIMEOUT)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and launched > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    if not dist.is_initialized():
        if device_mesh is not None:
            raise TopologyError("a device_mesh was given but torch.distributed is not initialised")
        rings(None, rtp_size, 1)  # validates rtp_size
        return Topology(0, 1, device, None, Ring(None))

    world = dist.get_world_size()
    if "WORLD_SIZE" in os.environ and launched != world:
        raise TopologyError(
            f"the launcher says WORLD_SIZE={launched} but the initialised process group has {world} ranks; "
            "start every rank with the same launcher settings (torchrun --nproc_per_node, accelerate --num_processes)"
        )
    if world == 1:
        rings(device_mesh, rtp_size, 1)  # validates
        return Topology(0, 1, device, None, Ring(None))
    everyone, backend, rank = tuple(range(world)), dist.get_backend(), dist.get_rank()
    control = _group("control", everyone, "gloo", timeout)
    rows, error = None, None
    try:
        rows = rings(device_mesh, rtp_size, world)
    except TopologyError as err:
        error = err
    raise_if_any_failed(error, control, TopologyError)  # one rank's bad layout is everyone's error, not a hang
    _agree_on_rings(rows, control)  # before any group of a ring: ranks asking for other groups would hang
    # Groups are made once per set of ranks, every rank making every group in one order (new_group is
    # collective over the world): per ring its own group for the ring (I5) and one for its mesh; per
    # column of the grid one to average rotated gradients over replicas; over everyone one for
    # replicated gradients and two small gloo ones for agreement and for meeting at entry.
    columns = [tuple(column) for column in zip(*rows)]
    ring_groups = {row: _group("ring", row, backend, timeout) for row in rows if len(row) > 1}
    mesh_groups = {row: _group("mesh", row, backend, timeout) for row in rows if len(row) > 1}
    replica_groups = {c: _group("replicas", c, backend, timeout) for c in columns if len(c) > 1}
    world_group = _group("mesh", everyone, backend, timeout)  # the flat ring's mesh group: same ranks, same group
    entry = _group("entry", everyone, "gloo", entry_timeout)
    dp_rank, row = next((i, row) for i, row in enumerate(rows) if rank in row)
    column = columns[row.index(rank)]
    ring, mesh = Ring(ring_groups.get(row)), None
    ring.replicas, ring.replica_count = replica_groups.get(column), len(column)
    if len(row) > 1:
        mesh = DeviceMesh.from_group(mesh_groups[row], device.type, mesh_dim_names=("rtp",))
        mesh.__class__ = RotationMesh
        mesh.replicas, mesh.replica_count = ring.replicas, ring.replica_count
    return Topology(rank, world, device, mesh, ring, control, entry, entry_timeout, world_group, dp_rank, len(rows))


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


def _agree_on_rings(rows: list[tuple[int, ...]], control: dist.ProcessGroup) -> None:
    everyone: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, rows, group=control)
    except RuntimeError as err:
        raise TopologyError(
            f"rank {dist.get_rank()} could not agree on the rings with the other ranks ({str(err).splitlines()[0][:200]}): "
            "every rank must call from_pretrained"
        ) from err
    if any(theirs != rows for theirs in everyone):
        layouts = sorted({str([len(r) for r in theirs]) for theirs in everyone})
        raise TopologyError(
            f"ranks asked for different rings ({', '.join(layouts)} ranks per ring): pass the same rtp_size or "
            "device_mesh on every rank"
        )


def _group(role: str, ranks: tuple, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    key = (role, ranks, backend, timeout, id(dist.group.WORLD))
    if key not in _groups:
        if not _groups:
            atexit.register(_destroy_groups)
        _groups[key] = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
    return _groups[key]


def _destroy_groups() -> None:
    """Tear hf_rtp's groups down while the world group still exists: left to interpreter shutdown,
    a gloo group can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        for group in _groups.values():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the user destroyed everything already
                pass
    _groups.clear()


def raise_if_any_failed(
    error: BaseException | None, group: dist.ProcessGroup | None = None, wrap: type[HfRtpError] = HfRtpError
) -> None:
    """Make a failure on one rank an error on every rank, instead of a hang in the next collective.

    Every rank raises the same class, naming the rank that failed: the failing rank's own class when
    it is an hf_rtp error, else `wrap` (the failing rank chains the original as its cause).
    """
    if not dist.is_initialized():  # one process: the same class a rank would raise, e.g. CheckpointError
        if error is None or isinstance(error, HfRtpError):
            if error is not None:
                raise error
            return
        raise wrap(f"{type(error).__name__}: {error}") from error
    mine = None
    if error is not None:
        name = type(error).__name__ if isinstance(error, HfRtpError) else wrap.__name__
        mine = (name, str(error) if isinstance(error, HfRtpError) else f"{type(error).__name__}: {error}")
    messages: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(messages, mine, group=group)
    except RuntimeError as err:  # gloo's words for a peer that is gone or silent
        raise wrap(
            f"rank {dist.get_rank()} could not agree with the other ranks ({str(err).splitlines()[0][:300]}): another "
            "rank died, was stopped, or did not reach the same call within HF_RTP_TIMEOUT. Check the other ranks' "
            "logs; every rank must make the same hf_rtp calls"
        ) from (error or err)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if isinstance(error, HfRtpError):
        raise error
    rank, (name, message) = failed[0]
    raised = CLASSES.get(name, wrap)(f"rank {rank} failed: {message}")
    raise raised from error
