"""Process groups and the 1-D `rtp` device mesh, from torchrun, accelerate or a single process.

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
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None
    ring: Ring
    control: dist.ProcessGroup | None = None
    """gloo, hf_rtp's timeout: error agreement and small objects"""
    entry: dist.ProcessGroup | None = None
    """gloo, the short entry timeout: where collective calls meet"""
    entry_timeout: timedelta = DEFAULT_ENTRY_TIMEOUT

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group replicated gradients and gathers use (the mesh's); None at world size 1."""
        return None if self.mesh is None else self.mesh.get_group()

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


def as_timedelta(value: float | timedelta | None, variable: str, default: timedelta) -> timedelta:
    """`value`, else the environment variable, else `default`. Seconds, or with a unit: "90s", "10m", "1h"."""
    if value is None:
        value = os.environ.get(variable) or None
        if value is None:
            return default
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*", str(value).lower())
        seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)] if match else float("nan")
    if not seconds > 0:
        raise TopologyError(
            f"{variable} (or timeout=) must be a positive duration: seconds like 600, or 90s, 10m, 1h; got {value!r}"
        )
    return timedelta(seconds=seconds)


def setup(
    device: str | torch.device | None = None,
    device_mesh: DeviceMesh | None = None,
    timeout: float | timedelta | None = None,
) -> Topology:
    """Join (or start) the process group the launcher describes and build the `rtp` mesh and ring."""
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
    ranks = tuple(device_mesh.mesh.flatten().tolist()) if device_mesh is not None else tuple(range(world))
    backend = dist.get_backend()
    # Four groups, made once per set of ranks (new_group is itself collective): the ring's own (I5),
    # the mesh's collectives, and two small gloo ones for agreement and for meeting at entry.
    ring = Ring(_group("ring", ranks, backend, timeout))
    mesh = DeviceMesh.from_group(_group("mesh", ranks, backend, timeout), device.type, mesh_dim_names=("rtp",))
    mesh.__class__ = RotationMesh
    control = _group("control", ranks, "gloo", timeout)
    entry = _group("entry", ranks, "gloo", entry_timeout)
    return Topology(dist.get_rank(), world, device, mesh, ring, control, entry, entry_timeout)


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
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
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
