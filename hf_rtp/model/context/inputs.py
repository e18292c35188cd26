"""The checks of a context-parallel block's inputs, on every rank of the ring together.

At the block's entry (`agree`): every rank was given the same sequence, the buffers are distinct tensors of one
length, and the sequence is long enough to give every rank tokens. At each forward (`check`): one all-gather on
the ring brings every rank's position_ids, padding extents and label count (the whole sequence's position_ids for
the rotary embeddings and the packed documents, the padding's shape, vanilla's divisor for the loss), then each
rank checks its own inputs and the ranks agree: all go on, or all raise naming what is wrong.
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...distributed.ranks.agreement import agreed
from ...distributed.transport.backends import backend_map
from ...errors import SettingError
from .interface import trust_kernels
from .run import IGNORE_INDEX, ContextRun, Facts

PER_TOKEN = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels", "token_type_ids")
"""a forward's keywords that hold one entry per token (dim 1 the sequence): each must be cut with the others"""


def tokens_of(kwargs: dict) -> torch.Tensor | None:
    tokens = kwargs.get("input_ids")
    return tokens if tokens is not None else kwargs.get("inputs_embeds")


def check(run: ContextRun, kwargs: dict) -> Facts:
    """A forward's inputs inside a block, checked on every rank together: all go on, or all raise. Returns (and
    keeps for the rotary embeddings and attention) what the inputs say about the whole sequence."""
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    per_token = [kwargs.get(name) for name in PER_TOKEN]
    batch = max((t.shape[0] for t in per_token if torch.is_tensor(t) and t.dim() >= 2), default=1)
    whole, padding, labels, divisors_differ = _gather(run, kwargs, batch)
    with agreed(run.control, SettingError):
        _check_inputs(run, kwargs, padding, batch)
        trust_kernels(run, kwargs)  # the ring attention's kernel probed on this rank: a refusal reaches every rank
        if divisors_differ:  # the same on every rank: each saw every rank's
            raise SettingError(
                "context parallelism: the ranks of a ring passed different num_items_in_batch; each divides its "
                "share of the sequence's loss by it, so it must be the same on every rank (count the labels of the "
                "whole batch before the block, not of a rank's cut inside it)"
            )
    assert positions is not None  # _check_inputs refuses a forward without them
    facts = Facts(positions, whole, None if mask is not None else _documents(whole), labels)
    run.facts[id(positions)] = facts
    return facts


HEAD = 5
"""columns before a rank's position_ids in the gather: last kept, -(first padded), label count, a divisor given,
its float64 bits"""


def _gather(run: ContextRun, kwargs: dict, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """One all-gather on the ring, every rank whatever it holds: each rank's label count, padding extents,
    `num_items_in_batch` and position_ids (a share of the wrong shape is sent as -1 and refused by the check after).
    Returns the whole sequence's position_ids [batch, S], per row (the last kept position, the first padded one),
    the label count, and whether the ranks were given different `num_items_in_batch`."""
    layout, size, local = run.layout, run.ring.size, run.layout.local_length(run.rank)
    widest = max(layout.local_length(r) for r in range(size))
    mine = torch.full((batch, HEAD + widest), -1, dtype=torch.long)
    mine[:, 1] = -layout.length  # -(the first padded position): none
    mine[:, 2:HEAD] = 0
    positions = kwargs.get("position_ids")
    if positions is not None and positions.dim() == 2 and tuple(positions.shape) in ((1, local), (batch, local)):
        mine[:, HEAD : HEAD + local] = positions.expand(batch, -1).to(torch.long).cpu()
    mask = kwargs.get("attention_mask")
    where = layout.positions(run.rank)
    if mask is not None and mask.dim() == 2 and tuple(mask.shape) == (batch, local):
        kept = mask.bool().cpu()
        mine[:, 0] = torch.where(kept, where, -1).amax(1) if local else -1
        mine[:, 1] = -torch.where(kept, layout.length, where).amin(1) if local else -layout.length
    shift = kwargs.get("shift_labels")
    if shift is not None and shift.shape[-1] == local:  # a wrong batch is refused by the check after
        mine[0, 2] = int((shift != IGNORE_INDEX).sum())
    divisor = kwargs.get("num_items_in_batch")
    if divisor is not None:  # as float64 bits: every rank must divide by the same number
        mine[0, 3] = 1
        mine[0, 4] = torch.tensor([float(divisor)], dtype=torch.float64).view(torch.long)[0]
    device = _collective_device(run)
    shares = [mine]
    if run.ring.group is not None:
        shares = [torch.empty_like(mine, device=device) for _ in range(size)]
        dist.all_gather(shares, mine.to(device), group=run.ring.group)
    everyone = torch.stack([s.cpu() for s in shares])  # [ranks, batch, HEAD + widest]
    whole = layout.unshard(list(everyone[:, :, HEAD:]), 1)
    padding = torch.stack([everyone[:, :, 0].amax(0), -everyone[:, :, 1].amax(0)])
    divisors = {tuple(everyone[rank, 0, 3:5].tolist()) for rank in range(size)}
    return whole, padding, everyone[:, 0, 2].sum(), len(divisors) > 1


def _collective_device(run: ContextRun) -> torch.device:
    """Where the ring's collectives take their tensors: on the CPU where the group has a backend for it (gloo beside
    NCCL in a world started with no backend or "cpu:gloo,cuda:nccl"), else NCCL's on the current GPU. Read from the
    group's backends, not its backend string ('undefined' for a world started without one)."""
    if run.ring.group is None or "cpu" in backend_map(dist.get_backend_config(run.ring.group)):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _documents(whole: torch.Tensor) -> tuple[tuple[int, ...], ...] | None:
    """Per row, where its packed documents start: wherever a position is not the one before plus one, as
    transformers finds packed sequences when there is no attention_mask. None when every row is one document."""
    starts = tuple((0, *(torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()) for row in whole)
    return None if all(s == (0,) for s in starts) else starts


def _check_inputs(run: ContextRun, kwargs: dict, padding: torch.Tensor, batch: int) -> None:
    """This rank's inputs inside a block, or SettingError naming what is wrong (agreed by the caller).
    `padding`: per row, (the last kept position, the first padded one) over the whole sequence; `batch`: the most
    rows any per-token input has."""
    local, length = run.layout.local_length(run.rank), run.layout.length
    for name in PER_TOKEN:  # a tensor of the batch that was not cut: the buffers left it out
        value = kwargs.get(name)
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] not in (1, batch):
            raise SettingError(
                f"context parallelism: {name} has {value.shape[0]} rows where the batch has {batch}: every per-token "
                "input of a forward holds the same rows"
            )
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length != local:
            raise SettingError(
                f"context parallelism: {name} holds the whole sequence's {length} tokens, but this rank holds "
                f"{local}: it was left out of the buffers the block cuts. Add it to `buffers` (buffer_seq_dims 1), "
                "or pass the whole batch to hf_rtp.context_parallel(model, batch), which cuts every such tensor"
            )
    tokens = tokens_of(kwargs)
    if tokens is not None and tokens.shape[1] != local:
        raise SettingError(
            f"context parallelism: rank {run.rank} was given {tokens.shape[1]} tokens, but holds {local} of the "
            f"{length}-token sequence: shard every buffer with a seq dim inside the block"
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
    if mask is not None and (mask.shape[-1] != local or mask.shape[0] != batch):
        raise SettingError(
            f"context parallelism: the attention_mask is {tuple(mask.shape)}, not this rank's ({batch}, {local}): "
            "cut it with the other buffers, one row per sequence"
        )
    if bool((padding[0] >= padding[1]).any()):
        raise SettingError(
            "context parallelism supports right padding only: this attention_mask masks tokens before others it "
            "keeps (left padding, or holes). Pad sequences on the right (tokenizer.padding_side = 'right')"
        )
    shift = kwargs.get("shift_labels")
    if shift is not None and (shift.shape[-1] != local or shift.shape[0] != batch):
        raise SettingError(
            f"context parallelism: shift_labels are {tuple(shift.shape)}, not this rank's ({batch}, {local}): cut "
            "them with the other buffers, one row per sequence"
        )
    if mask is not None and shift is not None:
        padded = ~mask.bool()
        if bool((shift[padded] != IGNORE_INDEX).any()):
            raise SettingError(
                "context parallelism: padding tokens carry labels (a padded position's shift_label is not -100). "
                "Vanilla computes their loss with attention masked to nothing, which ring attention does not "
                "reproduce: set labels to -100 on padding, as transformers' data collators do"
            )
    if kwargs.get("labels") is not None and shift is None:
        raise SettingError(
            "context parallelism needs shift_labels (labels shifted before sharding: a chunk's last token's "
            "target lies in another chunk). Trainer and hf_rtp.context_parallel(model, batch) add them; with "
            "maybe_context_parallel, add F.pad(labels, (0, 1), value=-100)[:, 1:] to the batch and to `buffers`"
        )
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or kwargs.get("use_cache"):
        raise SettingError(
            "context parallelism keeps no cache (past_key_values, use_cache=True): it trains whole sequences"
        )
    keep = kwargs.get("logits_to_keep")  # 0 (or False) keeps every position; transformers reads True as 1
    if torch.is_tensor(keep) or (keep is not None and not (isinstance(keep, numbers.Integral) and int(keep) == 0)):
        raise SettingError(
            f"context parallelism with logits_to_keep={keep!r}: a rank holds two chunks of the sequence (chunk r and "
            "2N-1-r), so the last positions the model keeps are its own chunks', not the sequence's, on every rank "
            "but the one holding the last chunk. Leave logits_to_keep unset inside the block (logits of every "
            "position: context_parallel_unshard puts them back in order)"
        )
    config = getattr(run.model, "config", None)
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        raise SettingError(
            "context parallelism with output_router_logits=True is not supported: the router's auxiliary loss is "
            "computed over each rank's tokens, not the sequence's. Set output_router_logits=False"
        )


def buffer_problem(buffers: Sequence[torch.Tensor], dims: Sequence[int], in_place: bool = True) -> str | None:
    """What is wrong with a block's buffers on this rank, or None: each is cut once along its dim, `in_place` as
    accelerate's `maybe_context_parallel` contract has it (else the caller replaces them)."""
    if len(buffers) != len(dims):
        return f"{len(buffers)} buffers but {len(dims)} buffer_seq_dims"
    if not buffers:
        return "no buffers: the block cuts the batch's tensors it is given (input_ids, labels, position_ids, ...)"
    seen: dict[int, tuple[int, int]] = {}
    for i, (b, d) in enumerate(zip(buffers, dims, strict=True)):
        if not torch.is_tensor(b):
            return f"buffer {i} is a {type(b).__name__}, not a tensor"
        if not -b.dim() <= d < b.dim():
            return f"buffer {i} has {b.dim()} dims, so buffer_seq_dims[{i}] = {d} is not one of them"
        if in_place and b.requires_grad:
            return (
                f"buffer {i} requires grad (embeddings computed in this step?): buffers are cut in place, which "
                "autograd refuses for it. Pass input_ids instead, or hf_rtp.context_parallel(model, batch), which "
                "cuts out of place"
            )
        if id(b) in seen and seen[id(b)][1] != d % b.dim():
            return f"buffer {i} is buffer {seen[id(b)][0]} again, cut along another dim"
        seen.setdefault(id(b), (i, d % b.dim()))
    distinct = [buffers[i] for i, _ in seen.values()] if in_place else []  # out of place, views are harmless
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            if _overlap(a, b):
                first, second = (next(k for k, x in enumerate(buffers) if x is t) for t in (a, b))
                return (
                    f"buffers {first} and {second} are different tensors sharing storage (a view of the other): "
                    "each is cut in place, so one would cut the other. Pass .clone() of one, or the same tensor once"
                )
    lengths = {b.shape[d] for b, d in zip(buffers, dims, strict=True)}
    if len(lengths) > 1:
        shapes = ", ".join(f"{tuple(b.shape)} (dim {d})" for b, d in zip(buffers, dims, strict=True))
        return f"the buffers' sequence dims differ in length: {shapes}"
    return None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


def agree(run: ContextRun, buffers: Sequence[torch.Tensor], topology, problem: str | None) -> None:
    """At a block's entry, on every rank of the world at once: no rank's buffers have a `problem`, every rank of a
    ring holds the same sequence (lengths, shapes and a checksum of the buffers' values), and that sequence gives
    every rank tokens. Every difference is named, on every rank."""
    topology.enter("context_parallel")
    shapes = [tuple(b.shape) for b in buffers] if problem is None else []
    digest = 0
    for b in buffers if problem is None else ():
        digest = zlib.crc32(b.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest)
    mine = (run.layout.length, shapes, digest, problem)
    everyone: list = [mine]
    ring_ranks = [0]
    if run.control is not None:
        everyone = [None] * dist.get_world_size(run.control)
        dist.all_gather_object(everyone, mine, group=run.control)
        ring_ranks = [dist.get_global_rank(run.ring.group, r) for r in range(run.ring.size)] if run.ring.group else [0]
    problems = [(r, s[3]) for r, s in enumerate(everyone) if s[3] is not None]
    if problems:
        raise SettingError(
            "context parallelism: "
            + "; ".join(f"rank {r}: {p}" for r, p in problems)
            + ". Every rank refuses the block (accelerator.maybe_context_parallel's buffers, or the batch given to "
            "hf_rtp.context_parallel)"
        )
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
    lengths = {s[0] for s in everyone}
    shortest, chunks = min(lengths), 2 * run.ring.size
    if shortest < chunks:
        raise SettingError(
            f"context parallelism: a sequence of {shortest} tokens is shorter than the {chunks} chunks a ring of "
            f"{run.ring.size} cuts it into (chunks r and {chunks - 1}-r per rank), so a rank would hold no tokens. "
            f"Run sequences shorter than {chunks} tokens outside the block, or pad them on the right to {chunks}"
        )
