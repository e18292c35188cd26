"""Rotated linears that a model calls on the same tokens, one after another (q, k and v; gate and up), moving
those tokens once.

When a forward moves tokens instead of weights (Ring.token_walk), each op costs a message to the next rank
and one back, whatever its size: on a decode step that latency, not the bytes, is the time. Linears of one
parent module with the same input width are siblings. A group learns, from the calls it sees, which of its
members the model calls with the tensor the first one got (the same memory, unchanged: token_walk.identities),
and from then on, in forwards without gradients that move tokens, the first one's walk computes all of
their outputs at once; the others find theirs waiting for their input, or walk alone. What is learnt is the
model's code path, the same on every rank, so every rank walks alike. Each output is computed as the
member's own walk would have: its own rows, F.linear, in the input's dtype.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.token_walk import identities
from .common import brought, cast_for_matmul, local, token_bound


class Siblings:
    """A group of rotated linears of one parent with the same in_features (layers.linear.RotatedLinear)."""

    def __init__(self, members: list[Any]):  # RotatedLinear (a layer of its own would import this module)
        self.members = members
        self.follow: dict[int, list[int]] = {}  # a member called first on some tokens -> those called on them next
        self._current: tuple[_Seen, int] | None = None  # the last tokens and who got them first
        self._waiting: dict[int, tuple[_Seen, torch.Tensor]] = {}  # a member -> (its input, its output)

    def __deepcopy__(self, memo):
        return self  # a copied member (PEFT's modules_to_save) is not a member: it walks alone

    def observe(self, index: int, x: torch.Tensor) -> None:
        """Learn the call order: `index` got `x`."""
        current = self._current
        if current is not None and current[0].is_(x):
            followers = self.follow.setdefault(current[1], [])
            if index != current[1] and index not in followers:
                followers.append(index)
        else:
            self._current = (_Seen(x), index)

    def forward(self, member: Any, x: torch.Tensor) -> torch.Tensor | None:
        """`member`'s output, from the group's walk, or None: the caller walks alone."""
        index = next((i for i, m in enumerate(self.members) if m is member), None)
        ring = member.ring
        if index is None or torch.is_grad_enabled() or ring.traffic is None:
            self._waiting.clear()
            return None
        waiting = self._waiting.pop(index, None)
        if waiting is not None and waiting[0].is_(x):
            return waiting[1]
        self.observe(index, x)
        group = [index, *self.follow.get(index, [])]
        if len(group) == 1:
            return None
        modules = [self.members[i] for i in group]
        outputs = _walk(modules, cast_for_matmul(x), ring)
        if outputs is None:
            return None
        for i, out in zip(group[1:], outputs[1:], strict=True):
            self._waiting[i] = (_Seen(x), out)
        return outputs[0]


class _Seen:
    """A tensor a group saw, by a weak reference (a prompt's hidden states must not outlive their layer) and its
    identity then: the same tensor, unchanged since (token_walk.identities), while it lives."""

    def __init__(self, x: torch.Tensor):
        self._ref, self._identity = weakref.ref(x), identities([x])

    def is_(self, x: torch.Tensor) -> bool:
        return self._ref() is x and identities([x]) == self._identity


def _walk(modules: list, x: torch.Tensor, ring) -> list[torch.Tensor] | None:
    """The outputs of every module in `modules` for `x`, by one token walk, or None when this forward's tokens do
    not move (too many, or more than agreed) for their weights together."""
    weights = [(local(m.weight), local(m.bias)) for m in modules]
    widths = [m.out_features for m in modules]
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_zeros(flat.shape[0], sum(widths))
    # global shapes, not this rank's chunks (uneven at some world sizes): every rank must decide alike
    size = weights[0][0].element_size()
    weight_bytes = sum(math.prod(s) for m in modules for s in m.layout.global_shapes) // ring.size * size
    bound = token_bound(ring, weight_bytes, [flat], out)
    if bound is None:
        return None
    offsets = [sum(widths[:k]) for k in range(len(widths))]
    starts = [m.layout.bounds(ring.rank)[0] for m in modules]

    def compute(tokens, into, _rows, _chunk):
        for (w, b), offset, start in zip(weights, offsets, starts, strict=True):
            into[:, offset + start : offset + start + w.shape[0]] = F.linear(
                tokens[0], w.to(tokens[0].dtype), None if b is None else b.to(tokens[0].dtype)
            )

    with torch.autocast(x.device.type, enabled=False):
        walked = ring.token_walk([weights[0][0]], modules[0].layout, [flat], [0.0], out, compute, bound, brought(ring))
    if walked is not None:
        return None  # some rank brought more tokens than agreed: every rank walks each op alone
    return [
        out[:, offset : offset + width].contiguous().view(*x.shape[:-1], width)
        for offset, width in zip(offsets, widths, strict=True)
    ]


def group(parent: nn.Module, linear: Any) -> None:
    """Make `parent`'s direct children of exactly `linear` with one input width (two or more) siblings."""
    by_width: dict[int, list[Any]] = {}
    child: Any
    for child in parent.children():
        if type(child) is linear and not child.bias_after_matmul:
            by_width.setdefault(child.in_features, []).append(child)
    for members in by_width.values():
        if len(members) > 1:
            siblings = Siblings(members)
            for m in members:
                m.siblings = siblings
