"""The block's API: `hf_rtp.context_parallel(model, batch)`, accelerate's `maybe_context_parallel` contract
(`sharded`), and `hf_rtp.context_parallel_unshard`, which gives a rank the whole sequence of its tensors in order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.ranks.agreement import agreed
from ...distributed.tensors.sequence import SequenceLayout
from ...errors import HfRtpError, SettingError
from ...private.transformers_names import attention_implementation, set_attention_implementation, supports_sdpa
from ..heads import is_causal_lm
from ..state import rotated_module, state_of
from .inputs import agree, buffer_problem
from .interface import calls_attention_interface
from .rope import whole_sequence_rotary
from .run import _ACTIVE, ATTENTION, IGNORE_INDEX, ContextRun, current


def check_cp_size(cp_size: int, ring_size: int) -> None:
    """accelerate's ParallelismConfig(cp_size=...) against the model's ring, which context parallelism runs on."""
    if cp_size not in (1, ring_size):
        raise SettingError(
            f"ParallelismConfig(cp_size={cp_size}), but the model's ring has {ring_size} ranks: hf_rtp runs context "
            f"parallelism over the ring, so cp_size must equal it (hf_rtp.from_pretrained(..., rtp_size={cp_size}) "
            f"for rings of {cp_size} ranks, dp_shard_size rings side by side, each its own sequences). Several data "
            "groups on one ring are not supported"
        )


@contextmanager
def running(model: nn.Module, length: int, cp_size: int | None = None) -> Iterator[ContextRun]:
    """Activate ring attention, and whole-sequence rotary embeddings, for one block over `length` tokens."""
    if _ACTIVE:
        raise SettingError("a context-parallel block is already running: blocks do not nest")
    state = state_of(model)
    topology, ring = state.topology, state.topology.ring
    inner = rotated_module(model)
    assert inner is not None  # state_of found it
    config = inner.config
    if cp_size is not None:
        check_cp_size(cp_size, ring.size)
    implementation = attention_implementation(config)
    name = type(inner).__name__
    if not is_causal_lm(inner):
        raise SettingError(
            f"context parallelism is for causal language models; {name}'s outputs (a pooled score, per-token "
            "classes) would be each rank's chunks'. Load it with hf_rtp.from_pretrained (AutoModelForCausalLM)"
        )
    if not calls_attention_interface(inner):
        raise SettingError(
            f"context parallelism is not supported for {name}: its attention layers call SDPA themselves rather "
            "than transformers' attention interface, which is where hf_rtp's ring attention runs"
        )
    if implementation != "sdpa":
        fix = (
            "load it with attn_implementation='sdpa'"
            if supports_sdpa(inner)
            else "transformers has no SDPA attention for it (soft-capping or attention sinks, which ring attention "
            "does not compute either), so it cannot run context parallelism"
        )
        raise SettingError(
            f"context parallelism runs SDPA's kernels, and {name}'s attention is {implementation!r}: {fix}"
        )
    run = ContextRun(inner, ring, SequenceLayout(length, ring.size), topology.control)
    _ACTIVE.append(run)
    try:
        set_attention_implementation(config, ATTENTION)
        with whole_sequence_rotary(run):
            yield run
    finally:
        set_attention_implementation(config, implementation)
        _ACTIVE.clear()
    if run.graphs and not run.backward_ran and torch.is_grad_enabled():
        raise HfRtpError(
            "a context-parallel block ran a forward that records gradients (in train or eval mode alike) but not "
            "its backward: call loss.backward() "
            "(accelerator.backward(loss)) inside the block, where the ring attention still knows the sequence; "
            "for a forward you do not backpropagate, use torch.no_grad()"
        )


@contextmanager
def _entered(
    model: nn.Module, buffers: Sequence[torch.Tensor], dims: Sequence[int], cp_size: int | None, in_place: bool
) -> Iterator[ContextRun | None]:
    """A block over `buffers` (their sequence along `dims`), entered and agreed by every rank; None on a ring of one,
    where the batch runs unchanged."""
    state = state_of(model)
    problem = buffer_problem(buffers, dims, in_place)
    if state.topology.ring.size == 1:
        if cp_size not in (None, 1):
            raise SettingError(f"cp_size={cp_size} needs a ring of {cp_size} ranks; this model's ring has one")
        if problem is not None:
            raise SettingError(f"context parallelism: {problem}")
        yield None
        return
    length = buffers[0].shape[dims[0]] if problem is None else 0
    with running(model, length, cp_size) as run:
        agree(run, buffers, state.topology, problem)
        yield run


@contextmanager
def sharded(
    model: nn.Module,
    buffers: Sequence[torch.Tensor],
    buffer_seq_dims: Sequence[int],
    no_restore_buffers: set | None = None,
    cp_size: int | None = None,
) -> Iterator[None]:
    """accelerate's `maybe_context_parallel` contract on a rotated model: `buffers` cut in place along their
    sequence dims for the block, restored after it unless in `no_restore_buffers`. A tensor listed twice (a batch
    whose labels are its input_ids) is cut once; buffers sharing storage, of different lengths, or that require
    grad (autograd forbids resizing them) are refused on every rank."""
    with _entered(model, buffers, buffer_seq_dims, cp_size, in_place=True) as run:
        if run is None:
            yield
            return
        keep = no_restore_buffers or set()
        once: dict[int, tuple[torch.Tensor, int]] = {}
        for b, d in zip(buffers, buffer_seq_dims, strict=True):
            once.setdefault(id(b), (b, d))
        saved = [(b, b.clone()) for b, _ in once.values() if not any(b is k for k in keep)]
        try:
            for b, d in once.values():
                local = run.layout.shard(b, d, run.rank)
                b.resize_(local.shape).copy_(local)
            yield
        finally:
            for b, original in saved:
                b.resize_(original.shape).copy_(original)


@contextmanager
def context_parallel(model: nn.Module, batch: dict) -> Iterator[dict]:
    """One sequence across the ring for a plain training loop: every rank passes the same `batch`.

        with hf_rtp.context_parallel(model, batch):
            loss = model(**batch).loss  # vanilla's loss over the whole sequence, on every rank
            loss.backward()             # inside the block
        hf_rtp.sync_grads(model)        # or DDP / accelerator.prepare: the replicated parameters' mean

    Adds what Trainer's context parallelism adds (position_ids 0..S-1, and shift_labels from labels), when
    absent; puts this rank's chunks (r and 2N-1-r of 2N) of every tensor of the batch whose dim 1 is the sequence
    in the batch, out of place (embeddings that require grad keep their graph); puts the batch's own tensors back
    after the block. Every rank of the ring must be given the same batch (checked). A ring of one runs the batch
    unchanged. Outputs without a loss (logits, hidden states) are this rank's tokens, chunks r and 2N-1-r in that
    order: `context_parallel_unshard` inside the block gives the whole sequence's."""
    tokens = batch.get("input_ids")
    if tokens is None:
        tokens = batch.get("inputs_embeds")
    if tokens is None:
        raise SettingError("hf_rtp.context_parallel needs input_ids or inputs_embeds in the batch")
    length = tokens.shape[1]
    original = dict(batch)
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(length, device=tokens.device).expand(tokens.shape[0], -1).contiguous()
    if batch.get("labels") is not None and batch.get("shift_labels") is None:
        batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    names = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == length]
    try:
        with _entered(model, [batch[n] for n in names], [1] * len(names), None, in_place=False) as run:
            if run is not None:
                for name in names:
                    batch[name] = run.layout.shard(batch[name], 1, run.rank)
            yield batch
    finally:
        batch.clear()
        batch.update(original)


def _unshard_problem(index: int, buffer, dim: int, local: int | None) -> str | None:
    """Why `buffer` (the index-th, its sequence along `dim`) cannot be put back together; None when it can. `local`:
    the positions this rank holds (None on a ring of one, which holds the whole sequence)."""
    if buffer is None and local is None:
        return f"buffer {index} is None, not a tensor"
    if buffer is None:
        return (
            f"buffer {index} is None, not a tensor. A training forward (model.train()) with labels on a rotated model "
            "returns no logits: hf_rtp's fused LM-head loss computes the loss without building the [tokens, vocab] "
            "logits. For logits, pass return_logits=True to that forward (model(**batch, return_logits=True)), run it "
            "in eval mode or without labels, or load with hf_rtp.from_pretrained(..., fused_loss=False)"
        )
    if not torch.is_tensor(buffer):
        return f"buffer {index} is a {type(buffer).__name__}, not a tensor"
    if not -buffer.dim() <= dim < buffer.dim():
        return f"seq_dims[{index}] is {dim}, but buffer {index} has {buffer.dim()} dims"
    if local is not None and buffer.shape[dim] != local:
        where = dim % buffer.dim()
        return f"buffer {index} has {buffer.shape[dim]} positions along dim {where}, this rank holds {local}"
    return None


def context_parallel_unshard(
    model: nn.Module, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]
) -> list[torch.Tensor]:
    """Inside a context-parallel block: each of this rank's tensors (its tokens along `seq_dims`: logits, hidden
    states, per-token losses) as the whole sequence's, in order, on every rank of the ring. torch's
    `context_parallel_unshard(mesh, buffers, seq_dims)` for a rotated model; collective over the ring, every rank
    must call it with tensors of the same shapes; no gradient flows through it. A buffer one rank cannot put back
    (None: the logits a training forward with labels does not build) is a SettingError on every rank."""
    run = current()
    inner = rotated_module(model)
    if len(buffers) != len(seq_dims):
        raise SettingError(f"{len(buffers)} buffers but {len(seq_dims)} seq_dims")
    if run is None and inner is not None and state_of(inner).topology.ring.size == 1:
        for i, (b, d) in enumerate(zip(buffers, seq_dims, strict=True)):
            problem = _unshard_problem(i, b, d, None)
            if problem is not None:
                raise SettingError(f"context_parallel_unshard: {problem}")
        return [b.detach() for b in buffers]  # a ring of one holds the whole sequence (I8)
    if run is None or run.model is not inner:
        raise SettingError(
            "context_parallel_unshard is called inside the model's context-parallel block, where the ring knows how "
            "the sequence was cut: call it in the `with` block that computed the tensors"
        )
    layout, size = run.layout, run.ring.size
    local, widest = layout.local_length(run.rank), max(layout.local_length(r) for r in range(size))
    with agreed(run.control, SettingError):  # one rank's unusable buffer is every rank's error, not a wait in a gather
        for i, (b, d) in enumerate(zip(buffers, seq_dims, strict=True)):
            problem = _unshard_problem(i, b, d, local)
            if problem is not None:
                raise SettingError(f"context_parallel_unshard: {problem}")
    wholes = []
    for b, d in zip(buffers, seq_dims, strict=True):
        d %= b.dim()
        part = b.detach().movedim(d, 0)
        padded = part.new_zeros((widest, *part.shape[1:]))
        padded[:local] = part
        staged = run.ring.transport == "staged"  # gloo serving CUDA tensors: it gathers host copies only
        sent = padded.cpu() if staged else padded.contiguous()
        shares = [torch.empty_like(sent) for _ in range(size)]
        dist.all_gather(shares, sent, group=run.ring.group)
        wholes.append(layout.unshard(shares, 0).movedim(0, d).to(b.device))
    return wholes
