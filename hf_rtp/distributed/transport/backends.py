"""How the ring's messages travel, decided from the backend that carries the tensors' device.

Not from the world's backend string: `init_process_group()` with no backend reports `'undefined'` from
`get_backend()` (torch then starts gloo for CPU tensors and NCCL for CUDA ones), torchtitan passes
`"cuda:nccl,cpu:gloo"`, accelerate `"nccl"`. `get_backend_config()` says which backend serves which device
type, whatever the string was; this module reads it. It communicates nothing: the ring (distributed/transport/ring.py)
posts the messages the way decided here, and the collectives outside the ring ask `staged` whether to take host
copies.

- "batched": NCCL. A send blocks its stream until the peer's matching receive is posted on the same stream
  (NCCL's point-to-point docs; pytorch #132852), so every hop's sends and receives are posted together
  (`batch_isend_irecv`), or a ring of two deadlocks on a hop larger than NCCL's internal buffers. NCCL
  ignores tags and does not raise when a peer dies: the ring adds a header to each hop and a watch
  (distributed/transport/watch.py) to keep its promises there.
- "plain": gloo on CPU tensors. Plain sends and receives, one by one (gloo's batched path has been seen to hang),
  on the group itself where the ring is unwatched; tags keep kinds of message apart, and a wait raises past the
  group's timeout.
- "staged": a backend that cannot send this device's tensors point to point (gloo on GPUs, as on Windows or
  a world started with `"cpu:gloo,cuda:gloo"`): each message is copied to host memory, sent over gloo and
  copied back. Slower (two copies per hop), never wrong.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from ...errors import TopologyError

Transport = Literal["batched", "plain", "staged"]
# Which device types each backend can send point to point (torch's backend table: gloo's send/recv take CPU
# tensors only; NCCL's CUDA ones); and which device types a bare backend name serves (BackendConfig's rule).
_SENDS = {"gloo": frozenset({"cpu"}), "nccl": frozenset({"cuda"})}
_SERVES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "ucc": ("cpu", "cuda")}


def backend_map(config: str) -> dict[str, str]:
    """{device type: backend} from a backend string or config: "nccl", "gloo", "cpu:gloo,cuda:nccl", ..."""
    config = config.strip().lower()
    if ":" not in config:
        if config in ("", "undefined"):  # what get_backend() says of a world started without a backend
            return {"cpu": "gloo", "cuda": "nccl"}
        return {device: config for device in _SERVES.get(config, ("cpu", "cuda"))}
    out = {}
    for part in config.split(","):
        device, _, backend = part.strip().partition(":")
        out[device.strip()] = backend.strip()
    return out


def transport_for(config: str, device_type: str) -> Transport:
    """How a ring whose group has backend config `config` moves tensors on `device_type` (refused by name when
    no backend of the group can carry them, even through host memory)."""
    backends = backend_map(config)
    backend = backends.get(device_type)
    if backend is not None and device_type in _SENDS.get(backend, {device_type}):  # others (ucc, mpi): as asked
        return "batched" if backend == "nccl" else "plain"
    cpu = backends.get("cpu")
    if device_type != "cpu" and cpu is not None and "cpu" in _SENDS.get(cpu, {"cpu"}):
        return "staged"  # the group's CPU backend carries a host copy of each message
    raise TopologyError(
        f"hf_rtp's ring cannot send {device_type} tensors on a process group whose backends are {config!r}: "
        f'start the world with a backend that carries them ("cpu:gloo,cuda:nccl" for GPUs, "gloo" for CPUs), '
        "or with no backend at all"
    )


def staged(group, device: torch.device) -> bool:
    """Whether `group`'s collectives must take host copies of `device`'s tensors: gloo serving CUDA tensors (a
    world started with "cpu:gloo,cuda:gloo", gloo on GPUs as on Windows). There gloo runs all_reduce and broadcast
    only (torch's backend table); its all_gather of CUDA tensors, which DTensor's full_tensor() issues, killed both
    ranks with SIGSEGV on an H100 (docs/testing.md). Such a collective is run on host copies, as the ring's hops
    are ("staged" above)."""
    if device.type == "cpu" or group is None:
        return False
    return transport_for(dist.get_backend_config(group), device.type) == "staged"
