"""`model.resize_token_embeddings` on a rotated model: vanilla's values, re-cut over the ring.

New rows are random (vanilla draws them from the old rows' mean and covariance, or from the init's
normal), and vanilla draws them through modules of the new size, so only the same draws in the same
order give the same values. Under DDP every rank runs the resize, each drawing from its own generator,
and DDP then broadcasts rank 0's values. hf_rtp does the same: every rank gathers the embedding and the
untied head whole and runs transformers' own `_get_resized_embeddings` / `_get_resized_lm_head` on
plain copies, so each rank's random state moves on exactly as a DDP rank's does (a LoRA or a dropout
mask drawn afterwards is vanilla's); then the writer (ring rank 0 of the first replica, global rank 0
by default) sends every rank its rows of its result. Each rank thus holds the old and new matrices
whole for the length of the call, which the warning says with their size; a rank that fails there
(out of memory) is an error on every rank, naming it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .. import faults, log
from ..distributed.ranks.agreement import agreed
from ..distributed.tensors.rotated import RotatedTensor
from ..distributed.tensors.sharding import ChunkLayout, chunk_rows
from ..distributed.transport.backends import staged
from ..errors import RotatedStateError, SettingError
from ..layers import RotatedEmbedding, RotatedLinear
from ..layers.common import local
from ..private.transformers_names import resized_embeddings, resized_lm_head
from .install import rotated_parameter
from .state import ATTRIBUTE


def resize_token_embeddings(
    model, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
) -> nn.Embedding:
    """Collective: every rank calls it with the same arguments. Vanilla's signature and result."""
    state = model.__dict__[ATTRIBUTE]
    topology = state.topology
    if topology.world_size == 1:  # one process: nothing rotated, nothing to send
        return type(model).resize_token_embeddings(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    old = embedding.weight.shape[0]
    size = _new_size(old, new_num_tokens, pad_to_multiple_of)
    if size is None:
        return embedding
    topology.enter("resize_token_embeddings")
    if size != old:
        tied = head is not None and head.weight is embedding.weight
        places = _places(topology)
        writer = places.index((0, 0))
        whole = {"embedding": _whole(embedding.weight)}
        if head is not None and not tied:
            whole["head"] = _whole(head.weight)
            if head.bias is not None:
                whole["head_bias"] = _whole(head.bias)
        log.warning(
            "resize_token_embeddings: every rank holds the embedding"
            + (" and the LM head" if len(whole) > 1 else "")
            + f" whole while it runs vanilla's resize (about {_megabytes(whole, size):.0f} MB), drawing from its own "
            f"generator as a DDP rank does; rank {writer}'s new rows are kept, as DDP keeps rank 0's"
        )
        with agreed(topology.control, RotatedStateError):  # a rank out of memory here: every rank's error
            faults.point("resize.draw")
            whole = _vanilla_resize(model, embedding, whole, tied, new_num_tokens, pad_to_multiple_of, mean_resizing)
        requires_grad = embedding.weight.requires_grad
        embedding.weight = _sent(whole["embedding"], embedding.weight, size, places, writer, topology)
        embedding.weight.requires_grad_(requires_grad)
        embedding.num_embeddings = size
        if embedding.padding_idx is not None and size - 1 < embedding.padding_idx:
            embedding.padding_idx = None
        if head is not None:
            requires_grad = head.weight.requires_grad
            if tied:
                head.weight = embedding.weight
            else:
                head.weight = _sent(whole["head"], head.weight, size, places, writer, topology)
                if head.bias is not None:
                    head.bias = _sent(whole["head_bias"], head.bias, size, places, writer, topology)
                head.weight.requires_grad_(requires_grad)
            head.out_features = size
        for module in (embedding, head):
            if isinstance(module, (RotatedEmbedding, RotatedLinear)):
                own = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
                module.layout = ChunkLayout(tuple(p.shape for p in own), topology.ring.size)
                topology.ring.plan(module.layout, local(module.weight))
        _forget_sources(model, state, [embedding, head])
    model.config.get_text_config().vocab_size = size
    model.vocab_size = size
    model.tie_weights()
    return model.get_input_embeddings()


def _new_size(old: int, new_num_tokens, pad_to_multiple_of) -> int | None:
    """The size vanilla's resize gives (its own checks, its own rounding), or None for no change at all."""
    if pad_to_multiple_of is not None:
        if not isinstance(pad_to_multiple_of, int):
            raise SettingError(
                f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which is not and "
                "integer. "
                "Please make sure to pass an integer"
            )
        base = old if new_num_tokens is None else new_num_tokens
        return math.ceil(base / pad_to_multiple_of) * pad_to_multiple_of
    return new_num_tokens


def _places(topology) -> list[tuple[int, int]]:
    """(replica, ring rank) of every global rank: a device_mesh may lay rings out in any order."""
    places: list = [None] * topology.world_size
    dist.all_gather_object(places, (topology.dp_rank, topology.rtp_rank), group=topology.control)
    return places


def _whole(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: a rotated one gathered over its ring (each replica's ring holds it all)."""
    with torch.no_grad():
        return param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def _vanilla_resize(model, embedding, whole, tied, new_num_tokens, pad_to_multiple_of, mean_resizing):
    """transformers' own resize on plain modules holding the whole tensors; what it leaves in them."""
    weight = whole["embedding"]
    plain = nn.Embedding(weight.shape[0], weight.shape[1], padding_idx=embedding.padding_idx, _weight=weight)
    plain = resized_embeddings(model, plain, new_num_tokens, pad_to_multiple_of, mean_resizing)
    out = {"embedding": plain.weight.data}
    if "head" in whole:
        with torch.device("meta"):  # a Linear's constructor draws its init: vanilla's head draws nothing here
            head = nn.Linear(whole["head"].shape[1], whole["head"].shape[0], bias="head_bias" in whole)
        head.weight = nn.Parameter(whole["head"])
        if "head_bias" in whole:
            head.bias = nn.Parameter(whole["head_bias"])
        head = resized_lm_head(model, head, plain.weight.shape[0], mean_resizing=mean_resizing)
        out["head"] = head.weight.data
        if head.bias is not None:
            out["head_bias"] = head.bias.data
    return out


def _sent(whole: torch.Tensor, old: torch.Tensor, size: int, places, writer: int, topology) -> nn.Parameter:
    """This rank's part of the writer's `whole`: its rows if `old` was rotated, else all of it."""
    shape = torch.Size((size, *old.shape[1:]))
    like = local(old).detach()
    if not isinstance(old, RotatedTensor):
        received = whole if topology.rank == writer else like.new_empty(shape)
        dist.broadcast(received, src=writer, group=topology.group)
        return nn.Parameter(received)
    ring = topology.rtp_size
    widest = chunk_rows(size, ring, 0)[1]
    on = torch.device("cpu") if staged(topology.group, like.device) else like.device  # gloo scatters host copies
    mine = like.new_zeros((widest, *shape[1:]), device=on)
    pieces = None
    if topology.rank == writer:
        pieces = []
        for _, ring_rank in places:
            start, end = chunk_rows(size, ring, ring_rank)
            padded = like.new_zeros((widest, *shape[1:]), device=on)
            padded[: end - start] = whole[start:end]
            pieces.append(padded)
    dist.scatter(mine, pieces, src=writer, group=topology.group)
    start, end = chunk_rows(size, ring, topology.rtp_rank)
    return rotated_parameter(mine[: end - start].to(like.device, copy=True), shape, topology)


def _forget_sources(model, state, modules) -> None:
    """The resized parameters are saved under their own names and new shapes."""
    resized = {id(p) for m in modules if m is not None for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in resized:
            state.sources.pop(name, None)


def _megabytes(whole, size: int) -> float:
    tensors = [t for t in whole.values() if t is not None]
    return sum(t.element_size() * t.numel() * (1 + size / max(t.shape[0], 1)) for t in tensors) / 2**20
