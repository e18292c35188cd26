"""Small pieces every rotated layer shares."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from collections.abc import Callable, Sequence
from typing import overload

import torch
from torch.distributed.tensor import DTensor

from ..distributed.tensors.rotated import RotatedTensor, local_chunk
from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.pool import HEADER_BYTES
from ..distributed.transport.ring import Ring
from ..private.torch_names import current_graph_task_id


@overload
def local(param: torch.Tensor) -> torch.Tensor: ...
@overload
def local(param: None) -> None: ...
def local(param: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's chunk, still connected to autograd so its gradient lands on the DTensor (a rotated
    parameter's as a RotatedTensor, see distributed.tensors.rotated)."""
    if param is None:
        return None
    if isinstance(param, RotatedTensor):
        return local_chunk(param)
    return param.to_local() if isinstance(param, DTensor) else param


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul on `x` in, or None when autocast is off."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def cast_for_matmul(x: torch.Tensor) -> torch.Tensor:
    """What autocast does to a matmul input; rotated Functions then run with autocast off and cast
    the weights they hold to the input's dtype, so outputs match vanilla under autocast too."""
    dtype = autocast_dtype(x)
    # autocast leaves float64 alone ("not eligible"), and so must we
    return x if dtype is None or not x.is_floating_point() or x.dtype == torch.float64 else x.to(dtype)


def add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in place when the dtypes agree; under autocast the product is bf16 and the
    accumulator keeps the parameter's dtype, as vanilla's gradient cast-back does."""
    if acc.dtype == a.dtype == b.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Dtypes whose GEMMs sum in float32 and round once, at the end (cuBLAS's and oneDNN's bf16 and fp16 kernels)"""

_OUT_DTYPE = {"cuda": True}  # torch.mm(..., out_dtype=torch.float32) works on this device type (checked at first use)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of matmul partials over the contraction dimension is kept in: float32 for bf16 and fp16
    (what their GEMM sums in before it rounds), the dtype itself otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def matmul_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` (2-D) in float32, its sums never rounded to a's bf16 or fp16: a partial of a sum over the
    contraction dimension that is rounded once, at its end, as vanilla's one GEMM rounds.

    On CUDA `torch.mm(a, b, out_dtype=torch.float32)` (torch >= 2.8, fp16/bf16 inputs: the GEMM writes its
    float32 accumulator); elsewhere (torch's CPU kernels have no out_dtype) the operands are upcast first, a copy
    of each in float32 for the matmul: products of bf16 or fp16 values are exact in float32, so the sum is the
    same float32 sum up to its order."""
    device = a.device.type
    if a.dtype == b.dtype and a.dtype in LOW_PRECISION and _OUT_DTYPE.get(device, False):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a build without the overload: upcast from now on
            _OUT_DTYPE[device] = False
    return a.float() @ b.float()


def add_matmul_summed(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b where `acc` sums partials over the contraction dimension (sum_dtype): in place when the dtypes
    agree (float32, float64: as before), else the partial in float32 unrounded (matmul_float32)."""
    if acc.dtype == a.dtype == b.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(matmul_float32(a, b))


Compute = Callable[[Sequence[torch.Tensor], torch.Tensor, tuple[int, int], Sequence[torch.Tensor]], None]


def rotate_forward(
    ring: Ring,
    own: Sequence[torch.Tensor],
    layout: ChunkLayout,
    tokens: Sequence[torch.Tensor],
    fill: Sequence[float],
    out: torch.Tensor,
    compute: Compute,
    dtype: torch.dtype | None = None,
    backward: bool = False,
    head: bool = False,
    blank: Callable[[torch.Tensor], None] | None = None,
    fold: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> int | None:
    """Fill `out` [tokens, ...] with an op's output for `tokens` (each [tokens, ...]): `compute(tokens, out,
    rows, chunk)` writes or adds the share of the chunk holding `rows`, zeros elsewhere.

    The weights walk the ring (Ring.forward_walk, `dtype`: what they travel in), unless the ranks agreed at
    this forward's start on so few tokens that moving them (their inputs and outputs, Ring.token_walk,
    padded with `fill`) costs less than the weight chunk's walk (Traffic.moves_tokens: bytes, and hops). An
    op that sees more tokens than the forward brought learns so from the walk, on every rank, and decides
    again by the true count. A
    backward's recomputation (gradient checkpointing) always moves weights: it runs outside the forward
    the ranks agreed on.
    `backward`: the op's backward reads what `compute` leaves of this rank's tokens beside `out` (the
    experts' activations), so the tokens move only when no rank's forward records gradients. `head`: an LM
    head, which generate calls on each sequence's last tokens (`logits_to_keep`): its walk starts at the most
    tokens any rank's head sees.
    `blank` and `fold`: how an output that is not a sum of the chunks' shares starts and joins (token_walk), where
    `out` starts as `blank` leaves it. Returns the rows each rank's tokens travelled in, or None: the weights walked
    (every rank alike, so a backward may follow the same way: layers/embedding.py).
    """
    weight_bytes = sum(math.prod(s) for s in layout.global_shapes) // ring.size * own[0].element_size()
    bound = token_bound(ring, weight_bytes, tokens, out, head=head, backward=backward)
    most = brought(ring, head)
    while bound is not None:
        (blank or torch.Tensor.zero_)(out)
        # None: done; else the most tokens any rank brought, more than `bound`: decide again by that bound
        largest = ring.token_walk(own, layout, tokens, fill, out, compute, bound, most, blank, fold)
        if largest is None:
            return bound
        # no rank brings more than the largest to the next walk: it reads no count on the host
        bound, most = token_bound(ring, weight_bytes, tokens, out, bound=largest), largest
        if bound is None:  # the weights walk after all: into `out` as the caller gave it, not the void walk's share
            (blank or torch.Tensor.zero_)(out)
    ring.forward_walk(own, layout, lambda rows, chunk: compute(tokens, out, rows, chunk), dtype=dtype)
    return None


def token_bound(
    ring: Ring,
    weight_bytes: int,
    tokens: Sequence[torch.Tensor],
    out: torch.Tensor,
    *,
    head: bool = False,
    backward: bool = False,
    bound: int | None = None,
) -> int | None:
    """How many token rows each rank sends if this op moves its tokens (rotate_forward), or None: it moves its
    weights (`weight_bytes` per rank). From numbers every rank agreed on: the same answer on every rank."""
    traffic = ring.traffic
    if traffic is None or ring.size == 1 or current_graph_task_id() != -1 or (backward and traffic.grad):
        return None
    if bound is None:
        bound = traffic.head if head else traffic.bound
    row_bytes = sum(math.prod(t.shape[1:]) * t.element_size() for t in (*tokens, out))
    # a walk holds a hop's message, the accumulator and its landing in one slot, N-1 hops' arrivals in the other,
    # each region followed by a watched hop's header (pool.header_room: at most HEADER_BYTES + 7 more)
    regions = max(ring.size - 1, 3)
    held = bound * (row_bytes + 8) * regions + 64 + (HEADER_BYTES + 8) * regions
    slot = ring.slot_bytes(out)
    return bound if traffic.moves_tokens(bound, weight_bytes, row_bytes, held, slot, ring.size) else None


def brought(ring: Ring, head: bool = False) -> int | None:
    """The tokens this rank's own forward brought to an op (those its head sees, to a head), or None where the forward's
    start did not count them (Ring.token_walk then reads the walk's largest count on the host)."""
    return None if ring.brought is None else ring.brought[1 if head else 0]


def own_bundle(weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    return [weight] if bias is None else [weight, bias]


def finish_weight_grads(ctx, landed, ring, inputs, positions=(1, 2)) -> list[torch.Tensor | None]:
    """Turn the summed accumulators that came home into DDP's mean, one per rotated input.

    `inputs` are the rotated chunks the accumulators belong to and `positions` their places among the
    Function's inputs (weight 1 and bias 2 for most ops); a grad is None where that input wants none
    (frozen, absent). On a 2-D grid the sum over the replicas follows the ring's: after autograd
    accumulates `.grad` where it will (distributed.tensors.replicas, overlapped with earlier layers' backward),
    else here, at once.
    """
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(positions):
        if landed is None or i >= len(landed) or not ctx.needs_input_grad[p]:
            grads.append(None)
            continue
        grad, replicas = landed[i], ring.replica_sum
        if replicas is not None and not replicas.deferred(inputs[i]):
            replicas.now(grad)
            grad.div_(replicas.count)
        grads.append(grad.div_(ring.size))
    return grads


def source_text(function) -> str | None:
    """The function's code without annotations, decorators, docstring or comments."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, ast.FunctionDef):
        return None
    tree.decorator_list, tree.returns = [], None
    for arg in tree.args.args:
        arg.annotation = None
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    return ast.unparse(tree)
