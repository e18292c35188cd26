"""Rotary embeddings inside a block see the whole sequence's positions, whatever their `rope_type`.

A rotary embedding module maps position_ids to (cos, sin). Some types read more than each position: `dynamic`
and Phi-3's `longrope` choose their frequencies from the largest position they are given (transformers'
`dynamic_rope_update`), so a rank given only its own chunks' positions (the rank without the last chunk) would
rotate with other frequencies than vanilla. By construction rather than by type, each rotary embedding module of
the model is called inside the block with the whole sequence's position_ids (gathered once per forward,
inputs.check), and its outputs are cut to this rank's tokens: every type transformers ships, and any a model
brings, computes exactly vanilla's (cos, sin) and updates its state as vanilla's does. The cost is the table for
S positions instead of S/N, once per forward (torchtitan likewise builds the whole table and cuts it as a buffer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...errors import SettingError
from .run import ContextRun


def _is_rotary(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding")


@contextmanager
def whole_sequence_rotary(run: ContextRun) -> Iterator[None]:
    """For the block: every rotary embedding module of the model computes from the whole sequence's positions."""
    handles = []
    for module in run.model.modules():
        if _is_rotary(module):
            handles.append(module.register_forward_pre_hook(_whole_positions(run), with_kwargs=True))
            handles.append(module.register_forward_hook(_local_rows(run), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _whole_positions(run: ContextRun):
    def hook(module, args, kwargs):
        if "position_ids" in kwargs:
            given = kwargs["position_ids"]
        elif len(args) > 1:
            given = args[1]
        else:
            given = None
        facts = run.facts.get(id(given)) if given is not None else None
        if facts is None:
            raise SettingError(
                f"context parallelism: {type(module).__name__} was called with positions other than the "
                "position_ids the model's forward was given (a model that derives its own positions, such as "
                "multimodal RoPE): its frequencies could not be computed from the whole sequence's positions"
            )
        whole = facts.whole[: given.shape[0]].to(given.device, given.dtype)
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": whole}
        return (args[0], whole, *args[2:]), kwargs

    return hook


def _local_rows(run: ContextRun):
    length = run.layout.length

    def hook(module, args, kwargs, output):
        rows = run.positions()

        def cut(x):
            if not torch.is_tensor(x) or x.dim() < 2 or x.shape[1] != length:
                raise SettingError(
                    f"context parallelism: {type(module).__name__} returned "
                    f"{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}, not a table of the sequence's "
                    f"{length} positions along dim 1, so it cannot be cut to this rank's tokens"
                )
            return x.index_select(1, rows.to(x.device))

        return tuple(cut(x) for x in output) if isinstance(output, tuple) else cut(output)

    return hook
