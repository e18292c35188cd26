"""Rotated linears that a model calls on the same tokens, one after another (q, k and v; gate and up), walking
the ring once for all of them.

Linears of one parent module with the same input width are siblings. Two ways:
- In a forward without gradients that moves tokens (a decode step, where each op's latency is the time), the
  first one's token walk carries the tokens once for all of them (`_walk`), each output computed as the member's
  own walk would have: its own rows, F.linear, no stacked copy of the weights. Its members: those STACKED names;
  else those the group learnt from the calls it sees, the ones the model calls with the tensor the first one got
  (the same memory, unchanged: token_walk.identities).
- Otherwise (and where those tokens do not move), members named together in STACKED (q/k/v, gate/up) walk their
  weights stacked (layers/stacked.py: one hop and one matmul per chunk for all of them, forward and backward), in
  training, prefill and a gradient checkpoint's recomputation alike, from the first forward on.
Quantized linears (layers/linear4bit.py, linear8bit.py) group with their own kind only (one bitsandbytes setting):
a STACKED set walks its packed rows stacked through that kind's own Function (`walk_rows`: one hop and one
bitsandbytes matmul per chunk, the whole biases in the stacked rows' order, nothing but each member's own piece
saved for backward), and where a forward's tokens move (a decode step) each member walks alone: their pieces are
bytes, not F.linear's weights, and stacking them would copy them at every step.
Either way the first member called computes the others' outputs, which find theirs waiting for their input, or
walk alone. What decides is the model's code path, the same on every rank, so every rank walks alike.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.tensors.sharding import StackedLayout
from ..distributed.transport.token_walk import identities
from ..errors import RotatedStateError
from .common import brought, cast_for_matmul, local, token_bound
from .stacked import stacked_linear

# Linears that read one tensor, by name (Llama-like families' q/k/v and gate/up; BERT-like query/key/value, which only
# plan="auto" reaches): the members that walk stacked.
# Declared, not learnt, so that every forward walks alike: the first after a load as the thousandth (a stacked
# matmul rounds at the ulp unlike each member's own, and a resumed run must repeat the run it resumes bit for bit),
# and a gradient checkpoint's recomputation as the forward it recomputes. A member then called on other tokens
# walks alone (its stacked output is dropped): right, only slower.
STACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))


class Siblings:
    """A group of rotated linears of one parent with the same in_features (layers.linear.RotatedLinear)."""

    def __init__(self, members: list[Any], stacked: tuple[tuple[int, ...], ...] = ()):
        self.members = members  # RotatedLinear (a layer of its own would import this module)
        # a member -> the others it walks stacked with (STACKED), whichever of them the model calls first
        self.stacked = {i: [j for j in together if j != i] for together in stacked for i in together}
        self._stacks: dict[tuple[int, ...], StackedLayout] = {}  # the members walking together -> their layout
        self._columns: dict[tuple[tuple[int, ...], torch.device], list[torch.Tensor]] = {}
        # quantized stacks: the position in the members' biases, end to end, of each stacked row
        self._orders: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
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
        if index is None:
            self._waiting.clear()
            return None
        if x.is_inference():  # no version counter to know the tokens by (torch.inference_mode): each walks alone
            self._waiting.clear()
            return None
        waiting = self._waiting.pop(index, None)
        if waiting is not None:
            if waiting[0].is_(x):
                return waiting[1]
            return None  # another member's walk computed this one for other tokens: it walks alone on these
        outputs: list[torch.Tensor] | None = None
        group: tuple[int, ...] = (index,)
        quantized = hasattr(member, "walk_rows")
        if quantized and not torch.is_grad_enabled() and _tokens_move(self, index, x):
            return None
        if not quantized and not torch.is_grad_enabled() and member.ring.traffic is not None:  # a decode step?
            self.observe(index, x)
            # those STACKED names, else those learnt: each computes its own rows, no stacked copy of the weights
            group = (index, *(self.stacked.get(index) or self.follow.get(index, [])))
            if len(group) > 1:  # None: these tokens do not move
                outputs = _walk([self.members[i] for i in group], cast_for_matmul(x), member.ring)
        if outputs is None:
            group = (index, *self.stacked.get(index, []))
            if len(group) == 1:
                return None
            outputs = self._stacked(group, [self.members[i] for i in group], x)
        for i, out in zip(group[1:], outputs[1:], strict=True):
            self._waiting[i] = (_Seen(x), out)
        return outputs[0]

    def _stacked(self, group: tuple[int, ...], modules: list, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of `modules` for `x` by one walk of their stacked weights (layers/stacked.py)."""
        layout = self._stacks.get(group)
        if layout is None:
            layout = self._stacks[group] = StackedLayout.of(tuple(m.layout for m in modules))
        weights = [local(m.weight) for m in modules]
        kinds = {(type(m), getattr(m, "spec", None), m.bias is None) for m in modules}
        if len({(w.dtype, w.device, w.shape[1:]) for w in weights}) > 1 or len(kinds) > 1:  # changed since grouped
            raise RotatedStateError(
                "linears grouped to walk stacked no longer share a kind, dtype, device and input width: "
                + ", ".join(
                    f"{type(m).__name__} {tuple(w.shape)} {w.dtype}" for m, w in zip(modules, weights, strict=True)
                )
                + ". Replacing a rotated linear or its weight after loading is not supported"
            )
        if hasattr(modules[0], "walk_rows"):  # quantized: its kind's own Function over the stacked packed rows
            columns = self._columns.get((group, x.device))
            if columns is None:
                columns = [torch.tensor(layout.columns(m), device=x.device) for m in range(len(modules))]
                self._columns[(group, x.device)] = columns
            order = self._orders.get((group, x.device))
            if order is None:
                order = self._orders[(group, x.device)] = torch.argsort(torch.cat(columns))
            return modules[0].walk_rows(x, modules, layout, (columns, order))
        biases = [local(m.bias) for m in modules] if modules[0].bias is not None else None
        return list(stacked_linear(x, modules[0].ring, layout, weights, biases))


class _Seen:
    """A tensor a group saw, by a weak reference (a prompt's hidden states must not outlive their layer) and its
    identity then: the same tensor, unchanged since (token_walk.identities), while it lives."""

    def __init__(self, x: torch.Tensor):
        self._ref, self._identity = weakref.ref(x), identities([x])

    def is_(self, x: torch.Tensor) -> bool:
        return self._identity is not None and self._ref() is x and identities([x]) == self._identity


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
        return None  # some rank brought more tokens than agreed: every rank walks them again, stacked or alone
    return [
        out[:, offset : offset + width].contiguous().view(*x.shape[:-1], width)
        for offset, width in zip(offsets, widths, strict=True)
    ]


def _tokens_move(siblings: Siblings, index: int, x: torch.Tensor) -> bool:
    """Whether a forward without gradients would move the tokens for `index`'s stacked set (a decode step): its
    quantized members then walk alone, each its own token walk, rather than copy their stacked pieces every step.
    From numbers every rank agreed on (layers/common.py's token_bound), so every rank decides alike."""
    modules = [siblings.members[i] for i in (index, *siblings.stacked.get(index, []))]
    ring = modules[0].ring
    if len(modules) == 1 or ring.traffic is None:
        return False
    weight_bytes = sum(math.prod(s) for m in modules for s in m.layout.global_shapes) // ring.size
    flat = modules[0].walk_input(x).reshape(-1, x.shape[-1])  # as the stacked walk would decide (4-bit: cast)
    return token_bound(ring, weight_bytes, [flat], flat.new_empty(0, sum(m.out_features for m in modules))) is not None


def _alike(members: list) -> bool:
    """One kind (and for a quantized one, one bitsandbytes setting), the same weights' dtype and row shape, all with a
    bias or none: what a stacked walk carries as one bundle. Not float rows beside a quantized sibling's packed
    bytes, which a load holds in plain linears until integrations/bitsandbytes.py swaps them (and groups again)."""
    return (
        len({(type(m), getattr(m, "spec", None), local(m.weight).dtype, local(m.weight).shape[1:], m.bias is None)
             for m in members}) == 1
    )  # fmt: skip


def group(parent: nn.Module, kinds: tuple[type, ...]) -> None:
    """Make `parent`'s direct children of exactly one of `kinds` with one kind and input width (two or more)
    siblings; those named together in STACKED, alike, walk stacked."""
    by_width: dict[tuple[type, int], list[tuple[str, Any]]] = {}
    child: Any
    for name, child in parent.named_children():
        if type(child) in kinds and not child.bias_after_matmul:
            by_width.setdefault((type(child), child.in_features), []).append((name, child))
    for named in by_width.values():
        if len(named) < 2:
            continue
        names = [name for name, _ in named]
        members = [child for _, child in named]
        present = [[names.index(n) for n in together if n in names] for together in STACKED]  # two or more of them
        stacked = tuple(tuple(p) for p in present if len(p) > 1 and _alike([members[i] for i in p]))
        siblings = Siblings(members, stacked)
        for m in members:
            m.siblings = siblings
        for together in stacked:  # a stacked walk's pieces fit the pool's slots, reserved before the first step
            layout = StackedLayout.of(tuple(members[i].layout for i in together))
            members[0].ring.plan(layout, local(members[0].weight))
