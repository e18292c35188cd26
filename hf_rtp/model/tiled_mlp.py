"""Tiled MLP (from_pretrained's `tiled_mlp`): a decoder layer's MLP, and the model's norms, run over tiles of
their tokens, so that at long sequences their working set is a tile's, not the sequence's (Arctic Long Sequence
Training's sequence tiling, arXiv 2506.13996).

An MLP is token-wise: each token's output depends on that token's input only, so the MLP of a tile of tokens (rows
of the input seen as [tokens, hidden]) is the MLP of those tokens. With gradients, each tile runs under
torch.utils.checkpoint (non-reentrant): the forward keeps no intermediate activation, only the tile's input, a view
of the layer's input which the untiled MLP keeps too; backward recomputes one tile at a time, so the MLP's
intermediates (gate, up, their product: about 3 x tokens x intermediate_size) exist for one tile at once, in forward
and in backward. The cost is one more forward of the MLP, as gradient checkpointing costs, and one walk of its
rotated weights per tile: tiles are long (8192 tokens by default) so that each walk's hops hide behind a tile's
matmuls.

A norm (RMSNorm, LayerNorm) normalizes each token over its hidden size: token-wise too. Llama's RMSNorm saves a
float32 copy of its input and of the normalized tokens for backward, in a bf16 model 4 bytes each per hidden value
beside the 2 of the input: two norms per decoder layer and the final one (at 524,288 tokens a rank of Llama-3-8B,
8.6 GB a copy). Tiled, a norm keeps only its input's tiles (views) and recomputes a tile's copies in backward: every
norm of the model but those inside an attention module (Qwen3's q_norm and k_norm, over a head's width), which
stay whole. Norms hold no rotated weight, so each rank tiles its own tokens.

What is tiled: an `mlp` child of a model's module whose own children are linears (rotated, quantized, or wrapped
by PEFT later), activations and dropouts only (Llama's, Qwen's, Mistral's, Gemma's, Phi-3's, GPT-2's), and every
module whose class is a norm (`_NORMS`) outside attention. A block of experts with a router (Mixtral's, Qwen-MoE's)
is not token-wise in what it returns (its router logits feed the auxiliary loss) and is refused by name when tiling
is asked for, left whole under "auto" (its layers' norms are tiled). An MLP whose dropout is active (training,
p > 0; an nn.Dropout inside it, or F.dropout called by its forward, as Starcoder2's) runs whole, with a warning:
per-tile masks would be other draws than vanilla's one.

Exactness: every token's output is computed by the same ops on a tile of rows (a GPU kernel may order a row's sums
by the number of rows it is given: rounding); the weights' gradients are summed over tiles, where vanilla sums over
all tokens in one matmul or reduction (summation order only).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import log
from ..distributed.tensors.sharding import chunk_rows
from ..errors import SettingError

TILE = 8192
"""tokens per tile by default: enough that a tile's matmuls hide its walk of the MLP's weights"""
AUTO_FROM = 2 * TILE
"""tiled_mlp="auto": tile an MLP whose input holds more tokens than this (per rank: under context parallelism, the
rank's own)"""
_PLAIN = (nn.Linear, nn.Dropout, nn.Identity)
_NOT_TOKEN_WISE = {"MultiheadAttention", "Softmax", "Softmin", "LogSoftmax", "Softmax2d"}  # torch "activations"
_NORMS = ("RMSNorm", "LayerNorm")
"""class-name endings of the norms tiled (transformers' LlamaRMSNorm, Qwen2RMSNorm, GemmaRMSNorm, ...; torch's
nn.LayerNorm and nn.RMSNorm): each normalizes a token over its last dimension"""


def _token_wise(module: nn.Module) -> bool:
    """Whether `module`'s children are all linears, activations or dropouts (nothing that routes or mixes tokens)."""
    from transformers.pytorch_utils import Conv1D

    for child in module.children():
        if isinstance(child, (*_PLAIN, Conv1D)):
            continue
        if type(child).__module__.startswith(("transformers.activations", "torch.nn.modules.activation")) and (
            type(child).__name__ not in _NOT_TOKEN_WISE
        ):
            continue
        return False
    return next(module.children(), None) is not None


def _dropping(module: nn.Module) -> bool:
    """Whether `module` draws a dropout mask in this forward: an nn.Dropout inside it with p > 0, or a forward that
    calls F.dropout itself (Starcoder2's and Seed-OSS's MLPs: `p=self.residual_dropout`) with any float attribute
    named for dropout above 0 (or none to read, where p comes from elsewhere)."""
    if not module.training:
        return False
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        return True
    if not _calls_dropout(type(module)):
        return False
    rates = [v for k, v in vars(module).items() if "drop" in k and isinstance(v, float)]
    return not rates or any(p > 0 for p in rates)


_CALLS_DROPOUT: dict[type[nn.Module], bool] = {}


def _calls_dropout(cls: type[nn.Module]) -> bool:
    """Whether `cls.forward`'s source calls torch's functional dropout (read once per class)."""
    if cls in _CALLS_DROPOUT:
        return _CALLS_DROPOUT[cls]
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source to read (a compiled class): no functional call seen
        source = ""
    _CALLS_DROPOUT[cls] = re.search(r"(functional|\bF)\.dropout\(", source) is not None
    return _CALLS_DROPOUT[cls]


def pinned(func, ring):
    """`func` (a model's `_gradient_checkpointing_func`) with the ring's most_tokens, as the layer's forward saw it,
    put back while that forward is recomputed in backward: another forward between the two (a batch of another
    length, an evaluation, generate) has replaced it since, and a recomputation that cut other tiles than its forward
    would save other tensors (non-reentrant checkpoint fails on it) or walk otherwise than it did."""

    def call(function, *args, **kwargs):
        most = ring.most_tokens

        def run(*inner, **named):
            now, ring.most_tokens = ring.most_tokens, most
            try:
                return function(*inner, **named)
            finally:
                ring.most_tokens = now

        return func(run, *args, **kwargs)

    return call


def tile_for(setting: bool | int | str, tokens: int) -> int | None:
    """Tokens per tile for an MLP input of `tokens` (on a ring, the most any rank brought) under `setting`, or None:
    whole. The one rule, for the forward and for the estimate (tools/memory.py)."""
    if setting is False:
        return None
    if setting == "auto":
        tile, above = TILE, AUTO_FROM
    elif setting is True:
        tile, above = TILE, TILE
    else:
        tile = above = int(setting)
    return tile if tokens > above else None


def install(model: nn.Module, setting: bool | int | str) -> int:
    """Give every token-wise `mlp` of `model`, and every norm outside attention, the tiled forward per `setting`
    (from_pretrained's tiled_mlp): False (never), "auto" (tiles of TILE tokens above AUTO_FROM), True (tiles of TILE
    tokens above one tile) or a positive int (tiles of that many tokens). Returns how many MLPs were given it.
    Refuses by name, with `setting` asked for explicitly, an `mlp` it cannot tile."""
    if setting is False:
        return 0
    count, warned = 0, set[bool]()  # non-empty once this model warned about an MLP's dropout
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != "mlp":
            continue
        if not _token_wise(module):
            if setting != "auto":
                raise SettingError(
                    f"tiled_mlp={setting!r}: {name} ({type(module).__name__}) is not a token-wise MLP (it holds "
                    f"{', '.join(sorted({type(c).__name__ for c in module.children()}))}): a block of experts "
                    "routes its tokens and returns its router's logits, which tiling would cut. Pass "
                    'tiled_mlp="auto" (which leaves such blocks whole) or False'
                )
            continue
        ring = next((m.ring for m in module.modules() if getattr(m, "ring", None) is not None), None)
        if ring is not None and ring.size == 1:
            ring = None
        tiled = functools.partial(_tiled, type(module).forward, setting, warned, ring)
        module.forward = types.MethodType(tiled, module)
        count += 1
    for module, width in _norms(model):  # no rotated weight inside: each rank tiles its own tokens
        tiled = functools.partial(_tiled_norm, type(module).forward, setting, width)
        module.forward = types.MethodType(tiled, module)
    return count


def uninstall(model: nn.Module) -> None:
    """Every tiled forward `install` gave `model` removed: its modules' own forwards back."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, types.MethodType) and getattr(forward.__func__, "func", None) in (_tiled, _tiled_norm):
            del module.forward


def _norms(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """Every norm of `model` (by class name, _NORMS) with no children of its own, outside attention modules, that
    normalizes each row over its last dimension, with that dimension's size."""
    found: list[tuple[nn.Module, int]] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            name = type(child).__name__
            if "Attention" in name:
                continue  # a query or key norm works on a head's width, inside the attention's own shapes
            if name.endswith(_NORMS) and next(child.children(), None) is None:
                width = _width(child)
                if width is not None:
                    found.append((child, width))
            else:
                visit(child)

    visit(model)
    return found


def _width(norm: nn.Module) -> int | None:
    """The size of the one last dimension `norm` normalizes over; None where it normalizes over something else."""
    if getattr(norm, "data_format", "channels_last") != "channels_last":
        return None  # ConvNext's, SAM's, GOT-OCR2's vision LayerNorms: over channels, dim 1 of [B, C, H, W]
    shape = getattr(norm, "normalized_shape", None)
    if shape is not None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return int(shape[0]) if len(shape) == 1 else None
    weight = getattr(norm, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


def _tiled_norm(plain, setting, width: int, self: nn.Module, x: Any, *args, **kwargs):
    """A norm's forward over tiles of rows (`_tiled`, no ring) where its input's last dimension is the one it
    normalizes (`width`); else its own."""
    if args or kwargs or not torch.is_tensor(x) or x.dim() < 2 or x.shape[-1] != width:
        return plain(self, x, *args, **kwargs)
    return _tiled(plain, setting, set(), None, self, x)


def _tiled(plain, setting, warned: set, ring, self: nn.Module, x: Any, *args, **kwargs):
    """The MLP's forward over tiles (rows of x as [tokens, hidden]: contiguous views, which every MLP's linears and
    GPT-2's Conv1D take) where `tile_for` says; else its own.

    On a ring (`ring`: its rotated linears walk it) every tile is a walk every rank makes, so every rank cuts as many
    tiles: by the most tokens any rank brought to the forward (Ring.most_tokens, agreed at its start and kept
    through its backward, where a gradient checkpoint recomputes the layer), each rank's own tokens in that many
    tiles of at most a tile's tokens (a rank with fewer has shorter or empty ones). Where a forward brought neither
    input_ids nor inputs_embeds to count, no rank tiles."""
    if args or kwargs or not torch.is_tensor(x) or x.dim() < 2:
        return plain(self, x, *args, **kwargs)
    tokens = x.shape[:-1].numel()
    most = tokens if ring is None else ring.most_tokens
    tile = None if most is None else tile_for(setting, most)
    if tile is None:
        return plain(self, x)
    if _dropping(self):
        if not warned:  # once per model
            warned.add(True)
            log.warning(
                f"{type(self).__name__}: tiled_mlp runs this MLP whole while its dropout is active (training, p > "
                "0): each tile would draw its own dropout mask, not vanilla's one over the whole input"
            )
        return plain(self, x)
    flat, count = x.reshape(-1, x.shape[-1]), math.ceil(most / tile)
    tiles = [flat[a:b] for a, b in (chunk_rows(tokens, count, i) for i in range(count))]
    if torch.is_grad_enabled():
        # one tile's intermediates at a time, in forward and in backward (the module docstring)
        outs = [checkpoint(plain, self, t, use_reentrant=False) for t in tiles]
    else:
        outs = [plain(self, t) for t in tiles]
    out = torch.cat(outs)
    return out.view(*x.shape[:-1], out.shape[-1])
