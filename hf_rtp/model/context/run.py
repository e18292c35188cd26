"""The block running now: its model, ring and cut of the sequence, and what each forward in it learned.

Every other module of the package reads the block through `active` / `current`; none keeps state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.tensors.sequence import SequenceLayout
from ...distributed.transport.ring import Ring
from ...errors import SettingError

ATTENTION = "hf_rtp_context"
"""the attention implementation a model's config names inside the block (transformers' AttentionInterface)"""
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Facts:
    """What one forward's inputs say about the whole sequence, learned in one gather over the ring (inputs.py)."""

    positions: torch.Tensor
    """this rank's position_ids, as the forward was given them (the key: rotary embeddings and attention get it)"""
    whole: torch.Tensor
    """the whole sequence's position_ids [batch, S], every rank's share in place"""
    documents: tuple[tuple[int, ...], ...] | None
    """per row, where its packed documents start; None when every row is one document (or a mask pads it)"""
    labels: torch.Tensor
    """the sequence's label tokens (shift_labels other than -100) over the whole ring: vanilla's divisor"""


@dataclass
class ContextRun:
    """One `with` block: the model, its ring and how the sequence is cut."""

    model: nn.Module
    ring: Ring
    layout: SequenceLayout
    control: dist.ProcessGroup | None
    graphs: int = 0
    """ring attentions run with autograd recording in this block"""
    calls: int = 0
    """ring attentions run in this block (every decoder layer's, every forward)"""
    facts: dict[int, Facts] = field(default_factory=dict)
    """id(position_ids) -> its forward's Facts: what each forward's rotary embedding and attention (and their
    recomputation under checkpointing, which passes the same tensor) work from"""
    backward_ran: bool = False
    shares: bool = False
    """the caller takes each rank's share of the loss, torch's convention (Trainer's count path: loss.py)"""

    @property
    def rank(self) -> int:
        return self.ring.rank

    def positions(self, device=None) -> torch.Tensor:
        return self.layout.positions(self.rank, device)

    def facts_for(self, positions: torch.Tensor | None) -> Facts | None:
        """The Facts of the forward that was given `positions`; a model whose layers are not given position_ids
        gets the latest forward's."""
        known = self.facts.get(id(positions)) if positions is not None else None
        if known is None and self.facts:
            known = next(reversed(self.facts.values()))
        return known


# The block running now, process-wide rather than per thread: autograd's device threads (CUDA's backward)
# recompute checkpointed layers outside the thread that entered the block, and must see it too.
_ACTIVE: list[ContextRun] = []


def current() -> ContextRun | None:
    return _ACTIVE[0] if _ACTIVE else None


def active(model: nn.Module) -> ContextRun | None:
    """The block `model` is running in, if any."""
    run = current()
    return run if run is not None and run.model is model else None


def refuse_inside(model: nn.Module, call: str) -> None:
    if active(model) is not None:
        raise SettingError(
            f"{call} inside a context-parallel block is not supported: generation needs each rank's whole "
            "sequence. Call it outside the block (the model is then an ordinary rotated model)"
        )
