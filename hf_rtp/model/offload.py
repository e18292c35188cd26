"""Checkpoint offload: transformers' own switch, `model.activation_checkpointing_enable(offload=True)` (Trainer:
`gradient_checkpointing_kwargs={"offload": True}`), on a model hf_rtp loaded.

Under gradient checkpointing each decoder layer keeps only its input for backward; at long sequences those inputs
are what is left (layers x tokens x hidden: 34 GB per GPU for Llama-3-8B at 1M tokens on 8). With `offload=True`,
transformers wraps each checkpoint in torch's `save_on_cpu`, whose copies run on the compute stream. hf_rtp keeps the
switch and its meaning and moves the copies off that stream (`HostOffload`): each input goes to pinned host memory on
a side stream as soon as the layer's forward has it, and comes back on that stream while the backward of the layer
after it runs (each unpack fetches the one packed before it), so the copies overlap compute by construction.

On the CPU the activations are in host memory already (and a CPU-only torch has no pinned allocator: there
transformers' `offload=True` fails with "pin_memory=True requires a CUDA or other accelerator backend"): hf_rtp
ignores the switch there, saying so, and checkpoints as without it.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .. import log
from .tiled_mlp import pinned

SMALL_BYTES = 1 << 20
"""saved tensors smaller than this stay where they are (a layer's position ids, a mask): a copy's latency for
nothing"""


class _Held:
    """A saved tensor in pinned host memory: the copy, the event that says it is done, and its way back."""

    __slots__ = ("__weakref__", "device", "event", "fetched", "host", "ready")

    def __init__(self, host: torch.Tensor, event: Any, device: torch.device):
        self.host, self.event, self.device = host, event, device
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None  # recorded on the side stream once `fetched` is on the device


class HostOffload:
    """Saved-tensor hooks that keep CUDA tensors in pinned host memory, copied on a side stream both ways."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        # what was packed, in order, weakly: autograd's graph holds each until its backward (or until it is freed
        # without one, when the entry dies with it)
        self._packed: list[weakref.ref[_Held]] = []

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type != "cuda" or t.numel() * t.element_size() < SMALL_BYTES:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written before it is read
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # t's memory is not handed out again before the copy has read it
        event = torch.cuda.Event()
        event.record(self.stream)
        held = _Held(host, event, t.device)
        self._packed = [r for r in self._packed if r() is not None]
        self._packed.append(weakref.ref(held))
        return held

    def _fetch(self, held: _Held) -> None:
        if held.fetched is None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(held.event)
                held.fetched = held.host.to(held.device, non_blocking=True)
                held.ready = torch.cuda.Event()
                held.ready.record(self.stream)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed)
        index = next((i for i, r in enumerate(self._packed) if r() is packed), None)
        if index is not None:
            del self._packed[index]
            before = self._packed[index - 1]() if index > 0 else None
            if before is not None:  # the layer before it recomputes next in backward: its input comes back meanwhile
                self._fetch(before)
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.ready)  # this tensor's copy only: the prefetch just posted stays in flight
        tensor = packed.fetched
        assert tensor is not None  # fetched above
        tensor.record_stream(current)
        return tensor


def _offloaded(hooks: HostOffload, function, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        return checkpoint(function, *args, **kwargs)


def install(model: Any, device: torch.device, ring: Any = None) -> None:
    """Wrap `model.activation_checkpointing_enable` so that `offload=True` means hf_rtp's side-stream offload on CUDA
    and is ignored, by name, on the CPU; every other argument as transformers takes it. On a ring (`ring`), every
    checkpointed layer recomputes with the tile count its forward had (tiled_mlp.pinned)."""
    plain = model.activation_checkpointing_enable

    @functools.wraps(plain)
    def enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False):
        if offload and device.type != "cuda":
            log.warning(
                f"activation_checkpointing_enable(offload=True) is ignored on {device}: the checkpointed activations "
                "are in host memory already (offload moves them off a GPU)"
            )
        plain(activation_checkpointing_kwargs, every_n_layers=every_n_layers, offload=False)
        wrapped: dict[int, Any] = {}  # the function transformers set, once per function
        for module in self.modules():
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is None:
                continue
            if id(func) not in wrapped:
                new = func
                if offload and device.type == "cuda":
                    kwargs = dict(activation_checkpointing_kwargs or {"use_reentrant": False})
                    new = functools.partial(_offloaded, HostOffload(device), **kwargs)
                if ring is not None:
                    new = pinned(new, ring)
                wrapped[id(func)] = new
            module._gradient_checkpointing_func = wrapped[id(func)]

    model.activation_checkpointing_enable = types.MethodType(enable, model)
