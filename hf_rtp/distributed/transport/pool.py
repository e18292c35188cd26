"""The buffers foreign pieces land in: one pool per ring, shared by every layer on it (DESIGN.md I3).

Two weight slots and two gradient slots, so a rotated op never holds more than its own chunk plus two foreign
ones, and nothing is allocated per step. A forward that moves tokens moves no weights, so its messages use the
weight slots too (distributed/transport/token_walk.py).

Every bundle carved here is followed by room for a header (`HEADER_BYTES`, at an offset aligned to 8), so a
watched ring (NCCL's) sends a hop's tensors and its header as one message: `wire` gives the bytes from a bundle's
first tensor to the end of its header, and the header as an int64. A hop that is one message costs one
transfer's latency and one post, where the header as a message of its own doubled both.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

VIEWS_KEPT = 64  # a model's walks ask for a handful; more would only keep views of old sequence lengths
HEADER_BYTES = 8  # a watched hop's header: its kind and count as one int64 (distributed/transport/ring.py)
HEADROOM = 16  # what a slot holds beyond its planned piece: that piece's header, at an offset aligned to 8
WIRES_KEPT = 256  # bundles a ring's walks send and receive: a handful a layout, a few a sequence length


def header_room(nbytes: int) -> int:
    """Bytes a region of `nbytes` takes with the header after it, the header's offset aligned to 8."""
    return nbytes + (-nbytes) % 8 + HEADER_BYTES


def _matmul_itemsize(like: torch.Tensor) -> int:
    """Bytes per element the largest planned piece will travel in: the autocast dtype's when autocast is
    on (an embedding's float32 lookup, which walks first, must not size the slot for float32 matmuls)."""
    size, device = like.element_size(), like.device.type
    if like.is_floating_point() and torch.is_autocast_enabled(device):
        size = min(size, torch.get_autocast_dtype(device).itemsize)
    return size


class BufferPool:
    """Flat byte buffers keyed by (role, slot, device); chunks are views carved from them in the dtype
    they travel in, so a float32 walk (an embedding's lookup) and a bf16 one (autocast's matmuls)
    share one slot instead of holding two."""

    def __init__(self):
        self._flat: dict[tuple, torch.Tensor] = {}
        self._planned: dict[torch.device, int] = {}
        self.allocations = 0  # how many flat buffers were ever created: tests and memory reports read it
        # the views `take` carved, by (role, slot, device, dtype, shapes): a walk asks for the same few at every hop,
        # and carving costs three tensor ops a view; dropped whenever a slot's buffer is replaced, and the oldest
        # beyond VIEWS_KEPT (token walks and ring attention ask by sequence length)
        self._views: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        # (first byte, end) of a bundle -> (its message's bytes, header included; the header as int64): `wire`
        self._wires: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def take(self, role: str, slot: int, shapes: Sequence[torch.Size], like: torch.Tensor) -> list[torch.Tensor]:
        """Views of `shapes` in `like`'s dtype, carved one after another from the slot. The same views for the same
        request: what a caller wrote in them stays until the slot is taken for something else."""
        known = (role, slot, like.device, like.dtype, tuple(shapes))
        views = self._views.get(known)
        if views is not None:
            self._views.move_to_end(known)
            return views
        size = like.element_size()
        need = header_room(sum(math.prod(s) for s in shapes) * size)
        key = (role, slot, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < need:
            # free the smaller buffer, and the views kept of it, before allocating the larger one
            self._flat.pop(key, None)
            flat = None
            for stale in [k for k in self._views if k[:3] == key]:
                del self._views[stale]
            self._wires.clear()  # they hold views of the buffer replaced: its memory would never be freed
            planned = self._planned.get(like.device, 0) * _matmul_itemsize(like) + HEADROOM
            flat = torch.empty(max(need, planned), dtype=torch.uint8, device=like.device)
            self._flat[key] = flat
            self.allocations += 1
        views, offset = [], 0
        for shape in shapes:
            n = math.prod(shape) * size  # offsets stay multiples of the element size: every view is aligned
            views.append(flat[offset : offset + n].view(like.dtype).view(shape))
            offset += n
        self._views[known] = views
        if len(self._views) > VIEWS_KEPT:
            self._views.popitem(last=False)
        return views

    def wire(self, bundle) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One message for `bundle`, tensors carved here one after another (by `take`, or regions of one view taken,
        each followed by its header's room): (its bytes from the first tensor to the end of the header after the
        last, that header as one int64). None for a bundle that is not such (a parameter's own rows, a caller's
        tensors): the ring then sends its tensors one by one."""
        first, last = bundle[0], bundle[-1]
        start = first.data_ptr()
        key = (start, last.data_ptr() + last.numel() * last.element_size())
        known = self._wires.get(key, False)
        if known is not False:
            return known  # type: ignore[return-value]
        found = None
        for flat in self._flat.values():
            base = flat.data_ptr()
            if flat.device != first.device or not base <= start < base + flat.numel():
                continue
            header = key[1] - base + (-(key[1] - base)) % 8
            if header + HEADER_BYTES <= flat.numel() and _consecutive(bundle):
                found = (
                    flat[start - base : header + HEADER_BYTES],
                    flat[header : header + HEADER_BYTES].view(torch.int64),
                )
            break
        if len(self._wires) >= WIRES_KEPT:
            self._wires.clear()
        self._wires[key] = found
        return found

    def plan(self, numel: int, like: torch.Tensor) -> None:
        """Size every slot for the largest piece up front (in elements: a slot first used by a bf16
        walk takes half the bytes of a float32 one), so none is regrown mid-step.

        Slots are still allocated on first use: gradient slots only once training starts.
        """
        self._planned[like.device] = max(self._planned.get(like.device, 0), numel)

    def planned_bytes(self, like: torch.Tensor) -> int:
        """What a slot first taken for `like` holds at least: the largest piece in the dtype it travels in."""
        return self._planned.get(like.device, 0) * _matmul_itemsize(like)

    def planned(self, device: torch.device) -> int:
        """The largest piece's elements planned for `device`'s slots (0 before any layer planned)."""
        return self._planned.get(device, 0)

    def buffers(self, role: str) -> list[torch.Tensor]:
        """The role's flat slots, as bytes."""
        return [t for (r, *_), t in self._flat.items() if r == role]


def _consecutive(bundle) -> bool:
    """Whether the tensors lie one after another in memory, each contiguous (at most 7 bytes between two: a
    token message's alignment)."""
    end = None
    for t in bundle:
        if not t.is_contiguous():
            return False
        if end is not None and not 0 <= t.data_ptr() - end < 8:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True
