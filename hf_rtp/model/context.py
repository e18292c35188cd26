"""Context parallelism on a rotated model: one sequence across the ring, for the length of a `with` block.

Inside the block each rank holds its chunks of the sequence (distributed.sequence). Every op but
attention works token by token, so the rotated layers run unchanged; attention is hf_rtp's ring
attention (layers.attention), reached through transformers' own attention interface under the name
`hf_rtp_context`, which the model's config carries only inside the block. The loss is vanilla's over
the whole sequence: each rank's tokens' loss divided by the sequence's label count, summed over the
ring (the sum's backward is a sum too, so every rank's gradient is the ring's; the data-parallel mean
then gives the whole sequence's gradient). Under Trainer, which passes `num_items_in_batch` and
multiplies the loss by the number of processes itself, the loss is left to it.

Right padding is exact (a token never attends to the padding after it; padded positions carry no labels), and
so are packed documents (position_ids restarting: each attends within its own, as transformers separates them);
what the ring attention does not reproduce is refused by name: left padding,
sliding windows shorter than the sequence, soft-capping, attention sinks, attention dropout,
implementations other than SDPA, and generation.
"""

from __future__ import annotations

import functools
import inspect
import sys
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..distributed.agreement import agreed
from ..distributed.ring import Ring
from ..distributed.sequence import SequenceLayout
from ..errors import HfRtpError, SettingError
from ..layers.attention import ring_attention
from ..private.transformers_names import (
    attention_implementation,
    set_attention_implementation,
    supports_sdpa,
)
from .heads import is_causal_lm
from .state import rotated_module, state_of

ATTENTION = "hf_rtp_context"
"""the attention implementation a model's config names inside the block (transformers' AttentionInterface)"""
IGNORE_INDEX = -100


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
    documents: dict = field(default_factory=dict)
    """id(position_ids) -> (position_ids, each row's packed documents' starts or None): what each forward's
    attention (and its recomputation under checkpointing, which passes the same tensor) attends within"""
    backward_ran: bool = False

    @property
    def rank(self) -> int:
        return self.ring.rank

    def positions(self, device) -> torch.Tensor:
        return self.layout.positions(self.rank, device)


# The block running now, process-wide rather than per thread: autograd's device threads (CUDA's backward)
# recompute checkpointed layers outside the thread that entered the block, and must see it too.
_ACTIVE: list[ContextRun] = []


def _current() -> ContextRun | None:
    return _ACTIVE[0] if _ACTIVE else None


def active(model: nn.Module) -> ContextRun | None:
    """The block `model` is running in, if any."""
    run = _current()
    return run if run is not None and run.model is model else None


def refuse_inside(model: nn.Module, call: str) -> None:
    if active(model) is not None:
        raise SettingError(
            f"{call} inside a context-parallel block is not supported: generation needs each rank's whole "
            "sequence. Call it outside the block (the model is then an ordinary rotated model)"
        )


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface under the name ATTENTION: ring attention inside a block."""
    run = _current()
    if run is None:  # a config that kept the name past its block (a copy made inside it): no sequence to attend to
        raise HfRtpError(
            f"{type(module).__name__} runs the attention implementation {ATTENTION!r} outside a context-parallel "
            "block: a config copied inside the block kept it. Set config._attn_implementation = 'sdpa' on the copy"
        )
    _check_attention(run, module, query, attention_mask, dropout, kwargs)
    run.calls += 1
    positions = kwargs.get("position_ids")
    known = run.documents.get(id(positions)) if positions is not None else None
    if known is None and run.documents:  # a model whose layers are not given position_ids: the latest forward's
        known = next(reversed(run.documents.values()))
    out = ring_attention(query, key, value, scaling, run.ring, run.layout, known[1] if known else None)
    if out.requires_grad:
        run.graphs += 1
        out.register_hook(lambda grad: _backward_seen(run, grad))
    return out.transpose(1, 2).contiguous(), None


def _backward_seen(run: ContextRun, grad):
    run.backward_ran = True
    return grad


def _check_attention(run: ContextRun, module, query, attention_mask, dropout, kwargs) -> None:
    """What the ring attention does not compute, refused by name (the same on every rank: it is the model's)."""
    name = type(module).__name__
    reasons = []
    if attention_mask is not None:
        reasons.append("a 4-D attention mask (only the causal mask of one whole sequence is supported)")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        reasons.append("non-causal attention")
    if module.training and dropout:
        reasons.append(f"attention dropout ({dropout}); set config.attention_dropout = 0.0")
    window = kwargs.get("sliding_window")
    if window is not None and window < run.layout.length:
        reasons.append(f"a sliding window of {window} tokens, shorter than the sequence ({run.layout.length})")
    if kwargs.get("softcap") is not None:
        reasons.append("attention logit soft-capping")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        reasons.append("attention sinks")
    if query.shape[2] != run.layout.local_length(run.rank):
        reasons.append(
            f"{query.shape[2]} query tokens where this rank holds {run.layout.local_length(run.rank)} of the sequence"
        )
    if query.device.type != "cpu":
        reasons.append(f"{query.device.type} tensors (ring attention runs SDPA's CPU flash kernel)")
    if reasons:
        raise SettingError(f"context parallelism: {name} uses " + "; ".join(reasons))


def _mask(*args, **kwargs):
    """The mask interface under ATTENTION: no mask, the ring attention is causal over global positions
    (forward checks that a 2-D mask only pads on the right, on every rank together)."""
    return None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)  # a new name: no other model's attention changes
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask)


def _padding(run: ContextRun, mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Per row of the batch, (the last kept position, the first padded one) over the whole sequence: one small
    all-reduce on every rank of the ring, whatever its mask, before the ranks agree on their inputs."""
    if run.ring.group is None:
        return None
    positions = run.positions(_collective_device(run))
    extent = torch.stack([torch.full((batch,), -1), torch.full((batch,), -run.layout.length)]).to(positions.device)
    if mask is not None and mask.dim() == 2 and mask.shape == (batch, positions.numel()):
        kept = mask.to(positions.device).bool()
        extent[0] = torch.where(kept, positions, -1).amax(1)
        extent[1] = -torch.where(kept, run.layout.length, positions).amin(1)
    dist.all_reduce(extent, op=dist.ReduceOp.MAX, group=run.ring.group)
    extent[1] = -extent[1]
    return extent


def _tokens(kwargs: dict) -> torch.Tensor | None:
    tokens = kwargs.get("input_ids")
    return tokens if tokens is not None else kwargs.get("inputs_embeds")


def _check_inputs(run: ContextRun, kwargs: dict, padding: torch.Tensor | None = None) -> None:
    """This rank's inputs inside a block, or SettingError naming what is wrong (agreed by the caller).
    `padding`: `_padding`'s extents."""
    local = run.layout.local_length(run.rank)
    tokens = _tokens(kwargs)
    if tokens is not None and tokens.shape[1] != local:
        raise SettingError(
            f"context parallelism: rank {run.rank} was given {tokens.shape[1]} tokens, but holds {local} of the "
            f"{run.layout.length}-token sequence: shard every buffer with a seq dim inside the block"
        )
    positions = kwargs.get("position_ids")
    if positions is None:
        raise SettingError(
            "context parallelism needs the sequence's global position_ids among the sharded buffers (Trainer "
            "adds them; hf_rtp.context_parallel(model, batch) adds them; with maybe_context_parallel, add "
            "torch.arange(seq_len) expanded to the batch to `buffers`)"
        )
    if positions.shape[-1] != local:
        raise SettingError(
            f"context parallelism: rank {run.rank}'s position_ids hold {positions.shape[-1]} tokens, not its "
            f"{local} of the sequence: shard them with the other buffers"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise SettingError(f"context parallelism takes a 2-D attention_mask (padding), not a {mask.dim()}-D one")
    if padding is not None and bool((padding[0] >= padding[1]).any()):
        raise SettingError(
            "context parallelism supports right padding only: this attention_mask masks tokens before others it "
            "keeps (left padding, or holes). Pad sequences on the right (tokenizer.padding_side = 'right')"
        )
    if mask is not None and kwargs.get("shift_labels") is not None:
        padded = ~mask.bool()
        if bool((kwargs["shift_labels"][padded] != IGNORE_INDEX).any()):
            raise SettingError(
                "context parallelism: padding tokens carry labels (a padded position's shift_label is not -100). "
                "Vanilla computes their loss with attention masked to nothing, which ring attention does not "
                "reproduce: set labels to -100 on padding, as transformers' data collators do"
            )
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise SettingError(
            "context parallelism needs shift_labels (labels shifted before sharding: a chunk's last token's "
            "target lies in another chunk). Trainer and hf_rtp.context_parallel(model, batch) add them; with "
            "maybe_context_parallel, add F.pad(labels, (0, 1), value=-100)[:, 1:] to the batch and to `buffers`"
        )
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or kwargs.get("use_cache"):
        raise SettingError(
            "context parallelism keeps no cache (past_key_values, use_cache=True): it trains whole sequences"
        )
    config = getattr(run.model, "config", None)
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        raise SettingError(
            "context parallelism with output_router_logits=True is not supported: the router's auxiliary loss is "
            "computed over each rank's tokens, not the sequence's. Set output_router_logits=False"
        )


def check(run: ContextRun, kwargs: dict) -> None:
    """A forward's inputs inside a block, checked on every rank together: all go on, or all raise; then the
    documents packed in each row, from the whole sequence's position_ids, for the ring attention."""
    tokens, mask, positions = _tokens(kwargs), kwargs.get("attention_mask"), kwargs.get("position_ids")
    batch = next((t.shape[0] for t in (tokens, positions, mask) if t is not None and t.dim() >= 2), 1)
    padding = _padding(run, mask, batch)
    everywhere = _whole_positions(run, positions, batch)
    with agreed(run.control, SettingError):
        _check_inputs(run, kwargs, padding)
    if positions is not None:
        run.documents[id(positions)] = (positions, None if mask is not None else _documents(everywhere))


def _whole_positions(run: ContextRun, positions: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The whole sequence's position_ids [batch, S], from every rank's share (one all-gather on the ring, every
    rank, whatever it holds: a share of the wrong shape is sent as -1 and refused by the check after)."""
    layout, size = run.layout, run.ring.size
    widest = max(layout.local_length(r) for r in range(size))
    local = layout.local_length(run.rank)
    mine = torch.full((batch, widest), -1, dtype=torch.long)
    if (
        positions is not None
        and positions.dim() == 2
        and positions.shape[0] in (1, batch)
        and positions.shape[-1] == local
    ):
        mine[:, :local] = positions.expand(batch, -1).to(mine.device, torch.long)
    mine = mine.to(_collective_device(run))
    shares = [mine] if run.ring.group is None else [torch.empty_like(mine) for _ in range(size)]
    if run.ring.group is not None:
        dist.all_gather(shares, mine, group=run.ring.group)
    whole = torch.full((batch, layout.length), -1, dtype=torch.long)
    for rank, share in enumerate(shares):
        whole[:, layout.positions(rank)] = share[:, : layout.local_length(rank)].cpu()
    return whole


def _collective_device(run: ContextRun) -> torch.device:
    """Where the ring's collectives take their tensors: NCCL's on the current GPU, gloo's on the CPU."""
    nccl = run.ring.group is not None and dist.get_backend(run.ring.group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _documents(whole: torch.Tensor) -> tuple[tuple[int, ...], ...] | None:
    """Per row, where its packed documents start: wherever a position is not the one before plus one, as
    transformers finds packed sequences when there is no attention_mask. None when every row is one document."""
    starts = tuple((0, *(torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()) for row in whole)
    return None if all(s == (0,) for s in starts) else starts


def attended(run: ContextRun, before: int) -> None:
    """After a forward: every decoder layer's attention ran the ring's. A model whose layers call SDPA themselves
    (Falcon) attended to each rank's chunks alone, the same on every rank: refused before any backward."""
    config: Any = run.model.config
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    ran = run.calls - before
    if layers is not None and ran != layers:
        raise SettingError(
            f"context parallelism is not supported for {type(run.model).__name__}: {ran} of its {layers} layers' "
            "attention went through transformers' attention interface, where hf_rtp's ring attention runs; the "
            "others call SDPA themselves, on each rank's chunks alone"
        )


def forward(run: ContextRun, plain, kwargs: dict):
    """The model's forward inside a block: inputs checked on every rank together, the loss the sequence's.

    It keeps no cache (use_cache=False, as TRL's trainers pass): transformers separates packed sequences
    (position_ids that restart) only when a forward has no cache, and a training forward in a block needs none."""
    check(run, kwargs)
    kwargs = {**kwargs, "use_cache": False}
    before = run.calls
    if kwargs.get("labels") is None or kwargs.get("num_items_in_batch") is not None:
        out = plain(**kwargs)  # Trainer: num_items_in_batch counts the sequence; it scales the loss itself
        attended(run, before)
        return out
    count = (kwargs["shift_labels"] != IGNORE_INDEX).sum()
    if run.ring.group is not None:
        dist.all_reduce(count, group=run.ring.group)
    out = plain(**{**kwargs, "num_items_in_batch": count})
    attended(run, before)
    loss = out[0] if isinstance(out, tuple) else out.loss
    if run.ring.group is not None:
        loss = _RingSum.apply(loss, run.ring.group)
    if isinstance(out, tuple):
        return (loss, *out[1:])
    out.loss = loss
    return out


@functools.cache
def _module_calls_interface(module_name: str) -> bool:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True  # no source to read: the count after each forward (attended) still guards it
    return "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source


def _calls_attention_interface(model: nn.Module) -> bool:
    """Whether the model's code reaches attention through transformers' interface (read once per modeling file;
    `attended` checks every forward's count besides)."""
    return _module_calls_interface(type(model).__module__)


def check_cp_size(cp_size: int, ring_size: int) -> None:
    """accelerate's ParallelismConfig(cp_size=...) against the model's ring, which context parallelism runs on."""
    if cp_size not in (1, ring_size):
        raise SettingError(
            f"ParallelismConfig(cp_size={cp_size}), but the model's ring has {ring_size} ranks: hf_rtp runs context "
            f"parallelism over the ring, so cp_size must equal it (hf_rtp.from_pretrained(..., rtp_size={cp_size}) "
            f"for rings of {cp_size} ranks, dp_shard_size rings side by side, each its own sequences). Several data "
            "groups on one ring are not supported"
        )


class _RingSum(torch.autograd.Function):
    """The sum over the ring of each rank's share of the loss; its backward sums too, so each rank's gradient
    is the ring's (the data-parallel mean over ranks then gives the whole sequence's gradient)."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


@contextmanager
def running(model: nn.Module, length: int, cp_size: int | None = None) -> Iterator[ContextRun]:
    """Activate ring attention for one block over a sequence of `length` tokens."""
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
    if not _calls_attention_interface(inner):
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
        yield run
    finally:
        set_attention_implementation(config, implementation)
        _ACTIVE.clear()
    if run.graphs and not run.backward_ran and torch.is_grad_enabled():
        raise HfRtpError(
            "a context-parallel block ran a training forward but not its backward: call loss.backward() "
            "(accelerator.backward(loss)) inside the block, where the ring attention still knows the sequence; "
            "for a forward you do not backpropagate, use torch.no_grad()"
        )


def agree(run: ContextRun, buffers: Sequence[torch.Tensor], topology) -> None:
    """Every rank of the ring holds the same sequence: lengths, shapes and a checksum of the buffers' values,
    compared on every rank at once, every difference named."""
    topology.enter("context_parallel")
    shapes = [tuple(b.shape) for b in buffers]
    digest = 0
    for b in buffers:
        digest = zlib.crc32(b.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest)
    mine = (run.layout.length, shapes, digest)
    if run.control is None:
        return
    everyone: list = [None] * dist.get_world_size(run.control)
    dist.all_gather_object(everyone, mine, group=run.control)
    ring_ranks = [dist.get_global_rank(run.ring.group, r) for r in range(run.ring.size)] if run.ring.group else [0]
    seen = {r: everyone[r] for r in ring_ranks}
    if len({(s[0], str(s[1])) for s in seen.values()}) > 1:
        raise SettingError(
            "context parallelism: the ranks of a ring were given different sequences: "
            + "; ".join(f"rank {r}: {s[0]} tokens, buffer shapes {s[1]}" for r, s in seen.items())
            + ". Every rank of a ring must get the same batch"
        )
    if len({s[2] for s in seen.values()}) > 1:
        raise SettingError(
            "context parallelism: the ranks of a ring were given different tokens ("
            + ", ".join(f"rank {r}: checksum {s[2]:08x}" for r, s in seen.items())
            + "). Every rank of a ring must get the same batch: one sequence is cut across the ring "
            "(accelerate's and Trainer's data loaders do this for cp_size; a plain loop must too)"
        )


@contextmanager
def sharded(
    model: nn.Module,
    buffers: Sequence[torch.Tensor],
    buffer_seq_dims: Sequence[int],
    no_restore_buffers: set | None = None,
    cp_size: int | None = None,
) -> Iterator[None]:
    """accelerate's `maybe_context_parallel` contract on a rotated model: `buffers` cut in place along their
    sequence dims for the block, restored after it unless in `no_restore_buffers`."""
    if len(buffers) != len(buffer_seq_dims):
        raise SettingError(f"{len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims")
    lengths = {b.shape[d] for b, d in zip(buffers, buffer_seq_dims, strict=True)}
    if len(lengths) != 1:
        raise SettingError(f"the buffers' sequence dims differ in length: {sorted(lengths)}")
    state = state_of(model)
    if state.topology.ring.size == 1:
        if cp_size not in (None, 1):
            raise SettingError(f"cp_size={cp_size} needs a ring of {cp_size} ranks; this model's ring has one")
        yield
        return
    keep = no_restore_buffers or set()
    with running(model, lengths.pop(), cp_size) as run:
        agree(run, buffers, state.topology)
        saved = [(b, b.clone()) for b in buffers if not any(b is k for k in keep)]
        try:  # a buffer that cannot be cut in place (a leaf that requires grad) leaves the others whole again
            for b, d in zip(buffers, buffer_seq_dims, strict=True):
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

    Adds what Trainer's context parallelism adds (position_ids 0..S-1, and shift_labels from labels), when
    absent; cuts every tensor of the batch whose dim 1 is the sequence into this rank's chunks (r and
    2N-1-r of 2N); puts the batch's own tensors back after the block. Every rank of the ring must be given
    the same batch (checked). A ring of one runs the batch unchanged."""
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
    for name in names:
        batch[name] = batch[name].clone()  # cut in place below: the caller's tensors stay whole
    try:
        with sharded(model, [batch[n] for n in names], [1] * len(names), set(batch[n] for n in names)):
            yield batch
    finally:
        batch.clear()
        batch.update(original)
