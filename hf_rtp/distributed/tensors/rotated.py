"""Rotated parameters: Shard(0) DTensors with data-parallel semantics.

DTensor's autograd assumes SPMD, every rank computing on the same data: the backward of
`full_tensor()` (a redistribute to Replicate) merely slices the incoming gradient, so a rank's
chunk would receive only its own batch's gradient. Under RTP each rank has its own batch, so the
gradient of a gathered rotated weight must be the mean over ranks, as DDP's is. This class gives
`full_tensor()` exactly that backward (sum over all ranks, then this rank's rows, divided by their
number; on a 2-D grid the sum runs over the ring, then over the replicas of this rank's rows) and
refuses the other redistributions under autograd, where there is no data-parallel answer.

Gradients and everything an op on a rotated tensor makes on the rotation mesh are rotated too, and
DTensor's implicit replication is on only while such an op runs (RotatedTensor.__torch_dispatch__; on torch
2.11, whose C++ dispatch skips it, __torch_function__), never for the process: other DTensor
code keeps torch's check for mixing (DESIGN.md, "Patches").
"""

from __future__ import annotations

import contextlib
import re
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...errors import CollectiveMisuseError, RotatedStateError
from ...private.torch_names import (
    SUBCLASS_DISPATCH_BYPASSED,
    OpOverload,
    OpOverloadPacket,
    amp_unscale,
    amp_unscale_function,
    disable_torch_function_subclass,
    foreach_type_lists,
    implicit_replication,
    local_tensor,
    op_schema,
    overload,
    set_implicit_replication,
)
from ..ranks import rendezvous
from ..transport import backends as transport
from . import blockwise, row_edits
from .sharding import chunk_rows

_PICKLE_REFUSED = (
    "refusing to pickle a rotated tensor: each rank holds other rows (and other data), so a pickled state "
    "dict written by one rank would silently hold that rank's slice. Save weights with "
    "model.save_pretrained(dir) on every rank, training state with hf_rtp.save_training_state(dir, model, "
    "optimizer, ...), or save through hf_rtp.Accelerator().save_state or transformers' Trainer (its checkpoints "
    "are collective once the model is loaded with hf_rtp.from_pretrained; hf_rtp.attach_trainer where it does not "
    "place the model itself)."
)


_C10D_REFUSED = (
    "{op} on a rotated tensor: a torch.distributed collective treats it as one tensor every rank holds, but each "
    "rank holds other rows of it, trained on other data. Its weights, gradients and optimizer state are already "
    "1/N per rank: ZeroRedundancyOptimizer has nothing left to shard (use its optimizer_class directly, e.g. "
    "torch.optim.AdamW), and gradients are averaged by backward (hf_rtp.sync_grads for the replicated ones)."
)


_MIXED_REFUSED = (
    "{op} mixed a rotated tensor with a plain one DTensor cannot place (it raised a bare AssertionError). The "
    "usual cause is an optimizer that keeps statistics over a whole weight in plain tensors, such as "
    "transformers' Adafactor (its factored second moment averages over all rows, which each rank holds only "
    "part of): use torch.optim.AdamW, Adam or SGD (Trainer: optim='adamw_torch') with a rotated model."
)


class RotationMesh(DeviceMesh):
    """The mesh of rotated parameters. Every DTensor derived from one (detached copies, gradients,
    optimizer moments) keeps this mesh, so this is where pickling them is refused: torch.save of a
    state dict, accelerate's and Trainer's pickle-based saves. Made only by `of`."""

    replicas: dist.ProcessGroup | None
    """on a 2-D grid, the group of this ring rank's replicas (the same rows, other data); else None"""
    replica_count: int
    """how many replicas hold these rows (1 on a flat ring)"""
    entry: dist.ProcessGroup
    """gloo over this ring with the short entry timeout: where a collective the user calls on a rotated
    tensor (full_tensor, redistribute) meets, so that a rank skipping it is named within that timeout"""
    entry_timeout: timedelta
    host: DeviceMesh | None
    """where the group's collectives need host copies of this mesh's tensors (backends.staged: gloo serving CUDA
    tensors), the same group as a CPU mesh, which gathers take instead (`_gathered`); else None"""

    @classmethod
    def of(
        cls,
        group: dist.ProcessGroup,
        device_type: str,
        replicas: dist.ProcessGroup | None,
        replica_count: int,
        entry: dist.ProcessGroup,
        entry_timeout: timedelta,
    ) -> RotationMesh:
        """The 1-D `rtp` mesh over a ring's `group`. DeviceMesh offers no constructor from a group that a
        subclass can extend, so torch's `from_group` builds it and this class is set on the result."""
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("rtp",))
        mesh.__class__ = cls
        mesh.replicas, mesh.replica_count = replicas, replica_count
        mesh.entry, mesh.entry_timeout = entry, entry_timeout
        mesh.host = None
        if transport.staged(group, torch.device(device_type)):
            mesh.host = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("rtp",))
        return mesh

    def meet(self, call: str) -> None:
        """Every rank of the ring enters `call`, or each that did fails with CollectiveMisuseError."""
        rendezvous.enter(call, self.entry, dist.get_rank(), self.size(), self.entry_timeout, "rank of the ring")

    def __reduce_ex__(self, protocol):
        raise RotatedStateError(_PICKLE_REFUSED)

    def __deepcopy__(self, memo):
        return self  # a handle on process groups, not data: copies of rotated tensors share it


_WRITE_REFUSED = (
    "refusing to write a rotated tensor as a whole tensor: this rank holds only its own rows. Save weights with "
    "model.save_pretrained(dir) on every rank (a PEFT model's too; or hf_rtp.Accelerator().save_model), training "
    "state with hf_rtp.Accelerator().save_state or hf_rtp.save_training_state(dir, model, optimizer, ...); for a PEFT "
    "adapter's state dict with its rotated tensors whole, hf_rtp.adapter_state_dict(model) on every rank."
)


COMPILE_REFUSED = (
    "torch.compile does not trace a model hf_rtp loaded: its rotated layers walk the ring with point-to-point "
    "sends inside autograd Functions, which dynamo cannot capture, and its parameters are DTensors of hf_rtp's own "
    "class. Run the model eagerly (drop torch.compile / torch_compile=True / --dynamo_backend)."
)


_GATHERED_ROWS_REFUSED = (
    "{op}: a backward through rows indexed from a rotated parameter (`w[7]`, `w[:5]` in a loss). DTensor gathered the "
    "rows, and its backward would give each rank's chunk only that rank's own batch's gradient (it assumes every "
    "rank has the same data), where DDP's is the mean over all ranks' batches. Index the whole tensor, whose gradient "
    "hf_rtp averages over the ranks: `w.full_tensor()[7]`. (Reading rows without a backward through them is fine.)"
)
# the backward ops of indexing rows (select, slice, narrow): on a rotated gradient they are DTensor's SPMD gather's
_ROWS_BACKWARD = (torch.ops.aten.select_backward.default, torch.ops.aten.slice_backward.default)


class _DataParallelGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.stride = param.device_mesh, param.shape, param.stride()
        return _gathered(DTensor.detach(param))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mesh = ctx.mesh
        group = mesh.get_group()
        grad = grad.contiguous().clone()
        with _named_if_skipped("the backward of full_tensor"):
            return _DataParallelGather._mean(ctx, grad, mesh, group)

    @staticmethod
    def _mean(ctx, grad, mesh, group):
        dist.all_reduce(grad, group=group)  # the sum over the ring's batches
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        start, end = chunk_rows(ctx.shape[0], world, rank)
        local = grad[start:end].contiguous()
        if mesh.replicas is not None:  # on a 2-D grid: and over the other replicas' batches
            dist.all_reduce(local, group=mesh.replicas)
        local.div_(world * mesh.replica_count)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=ctx.shape, stride=ctx.stride)


class RotatedTensor(DTensor):
    """The class of a rotated model's rotated parameters (nn.Parameters like any other), of their
    gradients and detached aliases (state dicts), and of every DTensor an op on them makes on the
    rotation mesh (optimizer moments, norms): all of them data-parallel values, each rank's own.

    An op with a rotated tensor among its arguments may mix in plain tensors, which DTensor then treats
    as replicated: a rotated model holds both kinds, and `clip_grad_norm_` or a foreach optimizer over
    all its parameters mixes them. This is DTensor's implicit replication, switched on for the duration
    of such an op only, so any other DTensor in the process (a TP or FSDP reference model) keeps
    torch's error for mixing."""

    __slots__ = ()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run_op(func, args, kwargs or {})

    # nn.Parameter(t) and Module._apply need detach(), copy.deepcopy needs clone(), to keep the class
    def detach(self) -> RotatedTensor:
        return _marked(DTensor.detach(self), type(self))  # a RowsCopy's detached alias is one too

    def clone(self, *args, **kwargs) -> RotatedTensor:
        return _marked(DTensor.clone(self, *args, **kwargs))

    def __setitem__(self, key, value) -> None:
        # vanilla's indexing is a view, DTensor's a gathered copy: write each rank's own rows (row_edits.py)
        if tuple(self.placements) == (Shard(0),):
            row_edits.assign(self, key, value)
        else:
            DTensor.__setitem__(self, key, value)

    def untyped_storage(self):
        # what safetensors (accelerate's default save_state, save_model, save_file) reads first; and what
        # dynamo reads of every parameter when torch.compile first traces the model
        raise RotatedStateError(COMPILE_REFUSED if torch.compiler.is_compiling() else _WRITE_REFUSED)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank (collective). Under autograd its gradient reaches each
        rank's chunk as the mean over all ranks' batches, as DDP's would."""
        if torch.is_grad_enabled() and self.requires_grad and grad_placements is not None:
            raise RotatedStateError("full_tensor(grad_placements=...) is not supported on a rotated parameter")
        self.device_mesh.meet("full_tensor")
        with _named_if_skipped("full_tensor"), _met():
            if torch.is_grad_enabled() and self.requires_grad:
                return _DataParallelGather.apply(self)
            return _gathered(DTensor.detach(self))

    def redistribute(self, device_mesh=None, placements=None, **kwargs) -> DTensor:
        if torch.is_grad_enabled() and self.requires_grad:
            raise RotatedStateError(
                "redistribute() on a rotated parameter under autograd would give each rank the gradient of its own "
                "batch only (DTensor assumes every rank has the same data). Use param.full_tensor(), whose gradient "
                "hf_rtp averages over ranks like DDP, or call it under torch.no_grad()."
            )
        if not _MET[0]:  # full_tensor redistributes: it met the ring already
            self.device_mesh.meet("redistribute")
        with _named_if_skipped("redistribute"):
            return _redistributed(DTensor.detach(self), device_mesh, placements, **kwargs)


def _run_op(func, args: tuple, kwargs: dict, as_dtensor: bool = True):
    """An op with rotated tensors among its arguments (RotatedTensor's class docstring): refused where it cannot
    mean anything per rank, an optimizer update on this rank's rows, else DTensor's op with implicit replication
    on for its duration; whatever it makes on the rotation mesh is rotated too. `as_dtensor`: the rotated
    arguments are DTensors for the op's duration (for an aten op; a Python function may call RotatedTensor's own
    methods, such as `untyped_storage`'s refusal, so __torch_function__ leaves them as they are)."""
    # DTensor's own handler for subclasses wraps every argument in a new DTensor; setting the class of
    # this op's rotated arguments to DTensor for the call (and back) does the same for a third of the cost
    rotated = [t for t in _tensors(args) if isinstance(t, RotatedTensor)]
    rotated += [t for t in _tensors(kwargs.values()) if isinstance(t, RotatedTensor)]
    swapped = [(t, type(t)) for t in rotated] if as_dtensor else []
    if any(isinstance(t, RowsCopy) for t in rotated) and _writes_a_copy(func, args, kwargs):
        row_edits.refuse_write(_op_name(func))
    if rotated and func in _ROWS_BACKWARD:
        raise RotatedStateError(_GATHERED_ROWS_REFUSED.format(op=_op_name(func)))
    if rotated and _namespace(func) == "c10d":
        raise RotatedStateError(_C10D_REFUSED.format(op=func))
    if rotated and _namespace(func) == "bitsandbytes":
        return blockwise.step_rows(overload(func), args, kwargs)  # an optimizer's update, on this rank's rows
    if func in _AMP_UNSCALE and not isinstance(args[0][0], DTensor):
        # in place per tensor, one found_inf for all: the order is free, and DTensor's handler wants a
        # DTensor first (it takes the mesh from it and reduces found_inf over the ring, for every tensor)
        args = (sorted(args[0], key=lambda t: not isinstance(t, DTensor)), *args[1:])
    allowed = implicit_replication()
    try:
        for t, _ in swapped:
            t.__class__ = DTensor
        set_implicit_replication(True)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as err:  # an op that redistributes communicates on the ring
            _raise_if_skipped(_op_name(func), err)
            raise
        except AssertionError as err:  # DTensor's, without a message: say what it means here
            raise RotatedStateError(_MIXED_REFUSED.format(op=_op_name(func))) from err
    finally:
        set_implicit_replication(allowed)
        for t, kind in swapped:
            t.__class__ = kind
    if isinstance(out, DTensor) and _is_view(func) and _is_rows_copy(out, rotated):
        return _marked(out, RowsCopy)  # a gathered copy where vanilla gives a view: writes into it are refused
    return _marked_outputs(out)


def _is_view(func) -> bool:
    """Whether vanilla's `func` returns a view of its input (`aten.slice`, `select`; `Tensor.__getitem__` as
    __torch_function__ sees it)."""
    if isinstance(func, OpOverload):
        returns = op_schema(func).returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return getattr(func, "__name__", None) in _VIEW_FUNCTIONS


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})
_VIEW_FUNCTIONS = frozenset({"__getitem__", "narrow", "select"})


def _is_rows_copy(out: DTensor, rotated: list) -> bool:
    """Whether a view op's output is a copy (it shares no rotated argument's storage, as DTensor's gather of rows
    gives), or a view of a RowsCopy."""
    ptr = local_tensor(out).untyped_storage().data_ptr()
    shared = [t for t in rotated if local_tensor(t).untyped_storage().data_ptr() == ptr]
    return not shared or any(isinstance(t, RowsCopy) for t in shared)


def _writes_a_copy(func, args: tuple, kwargs: dict) -> bool:
    """Whether `func` writes in place into a RowsCopy (rows gathered from a rotated tensor), which vanilla's view
    would have written through to the tensor."""
    if isinstance(func, OpOverload):
        schema = op_schema(func)
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if not written:
            return False
        values = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
        return any(isinstance(t, RowsCopy) for name in written for t in _tensors([values.get(name)]))
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS
    return in_place and bool(args) and isinstance(args[0], RowsCopy)


def _marked_outputs(out):
    """`out` (a tensor, or a list or tuple of them) with every DTensor on the rotation mesh rotated."""
    if isinstance(out, DTensor):
        return _marked_if_rotation(out)
    if isinstance(out, (list, tuple)):
        for t in out:
            if isinstance(t, DTensor):
                _marked_if_rotation(t)
    return out


# GradScaler's unscale, as __torch_dispatch__ sees it (the aten op) and as __torch_function__ does (torch's function)
_AMP_UNSCALE = (amp_unscale, amp_unscale_function)


def _namespace(func) -> str | None:
    """The library an op belongs to ("aten", "c10d", "bitsandbytes"), from an op overload or packet; None for a
    Python function (what __torch_function__ also sees: torch.add, Tensor.grad's getter)."""
    name = getattr(func, "namespace", None) or getattr(func, "_qualified_op_name", "").partition("::")[0]
    return name or None


def _op_name(func) -> str:
    """How an error names the op: "aten.mm.default" as __torch_dispatch__ sees it, "torch.Tensor.matmul" or
    "torch.nn.functional.linear" as __torch_function__ does."""
    name = getattr(func, "__name__", None)
    if _namespace(func) is not None or not name:
        return str(func)
    if getattr(func, "__objclass__", None) is not None:  # a method of torch.Tensor, implemented in C
        return f"torch.Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{_MODULES.get(module, module)}.{name}"


_MODULES = {"torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch"}
# what __torch_function__ hands over that is an op (implemented in C, or a torch.ops overload), as against a Python
# function that torch also routes through it (Tensor.backward, __deepcopy__, F.dropout): those run as they are
_OPS = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    OpOverload,
    OpOverloadPacket,
)


def _torch_function(cls, func, kinds, args=(), kwargs=None):
    """torch 2.11 dispatches every DTensor op in C++, a subclass's too, and never calls its
    __torch_dispatch__ (#167051; 2.12 calls it again): there RotatedTensor does the same one level up, for the
    ops called from Python (optimizers, clip_grad_norm_, GradScaler, state dicts, torch.ops). A Python function
    torch routes here too (Tensor.backward, F.dropout) and an attribute's getter (`.grad`, `.shape`) run as they
    are, without implicit replication, their outputs marked. Ops autograd calls from C++ get DTensor's own
    handling: hf_rtp's layers compute on local tensors, and a rotated parameter's gradient is marked where Python
    reads it (`.grad`)."""
    kwargs = kwargs or {}
    with disable_torch_function_subclass():
        if isinstance(func, _OPS) and getattr(func, "__name__", None) != "__get__":
            return _run_op(func, args, kwargs, as_dtensor=False)
        return _marked_outputs(func(*args, **kwargs))


if SUBCLASS_DISPATCH_BYPASSED:
    RotatedTensor.__torch_function__ = classmethod(_torch_function)


def whole(tensor: DTensor) -> torch.Tensor:
    """Collective, without autograd: the whole tensor, for hf_rtp's code inside a call the ranks have already
    met at (a forward), so without full_tensor's entry meeting."""
    with torch.no_grad(), _named_if_skipped("gathering a rotated tensor"), _met():
        return _gathered(tensor.detach())


def _on_host(tensor: DTensor) -> DTensor | None:
    """`tensor` (detached) as a DTensor of host copies on its mesh's CPU twin, where the mesh has one."""
    host = getattr(tensor.device_mesh, "host", None)
    if host is None:
        return None
    return DTensor.from_local(tensor.to_local().cpu(), host, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())  # fmt: skip


def _gathered(tensor: DTensor) -> torch.Tensor:
    """DTensor's full_tensor of a detached `tensor`, through host memory where the group needs it
    (RotationMesh.host)."""
    on_host = _on_host(tensor)
    if on_host is None:
        return DTensor.full_tensor(tensor)
    return DTensor.full_tensor(on_host).to(tensor.device)


def _redistributed(tensor: DTensor, device_mesh, placements, **kwargs) -> DTensor:
    """DTensor's redistribute of a detached `tensor` over its own mesh, through host memory where the group needs
    it (RotationMesh.host); the result back on the mesh and device it came from."""
    on_host = _on_host(tensor)
    if on_host is None or device_mesh not in (None, tensor.device_mesh):
        return DTensor.redistribute(tensor, device_mesh, placements, **kwargs)
    moved = DTensor.redistribute(on_host, on_host.device_mesh, placements, **kwargs)
    return DTensor.from_local(moved.to_local().to(tensor.device), tensor.device_mesh, moved.placements,
                              run_check=False, shape=moved.shape, stride=moved.stride())  # fmt: skip


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows [start, end) of a rotated parameter this rank holds, in the global tensor (the same rows on
    disk, in memory and in the ring: I2). A tensor that is not rotated is held whole."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    mesh = tensor.device_mesh
    return chunk_rows(tensor.shape[0], mesh.size(), mesh.get_local_rank())


def rows_of(tensor: DTensor, indices: list[int]) -> torch.Tensor:
    """Collective over the ring, without autograd: rows `indices` of a Shard(0) rotated tensor, whole on every
    rank. Each rank fills the rows it holds and zeros elsewhere; one sum over the ring (exact: one term is
    nonzero) puts every row everywhere, without gathering the rest of the tensor."""
    with torch.no_grad(), _named_if_skipped("reading rows of a rotated tensor"):
        mesh, chunk = tensor.device_mesh, local_tensor(tensor)
        start, _ = chunk_rows(tensor.shape[0], mesh.size(), mesh.get_local_rank())
        out = chunk.new_zeros((len(indices), *tensor.shape[1:]))
        for j, i in enumerate(indices):
            if 0 <= i - start < chunk.shape[0]:
                out[j] = chunk[i - start]
        dist.all_reduce(out, group=mesh.get_group())
        return out


_MET = [False]
_COMMUNICATION_FAILED = re.compile(r"timed out|connection closed|connection reset|gloo/transport|NCCL", re.IGNORECASE)


@contextlib.contextmanager
def _met():
    before, _MET[0] = _MET[0], True
    try:
        yield
    finally:
        _MET[0] = before


@contextlib.contextmanager
def _named_if_skipped(call: str):
    """A collective on a rotated tensor that times out or loses a rank (one rank ran it, another did
    not) is a CollectiveMisuseError naming it, not gloo's or NCCL's bare message."""
    try:
        yield
    except RuntimeError as err:
        _raise_if_skipped(call, err)
        raise


def _raise_if_skipped(call: str, err: RuntimeError) -> None:
    # functional collectives (DTensor's redistribution inside an op) raise the backend's plain RuntimeError
    if isinstance(err, CollectiveMisuseError):
        return  # named already, deeper down
    if isinstance(err, dist.DistError) or _COMMUNICATION_FAILED.search(str(err)):
        raise CollectiveMisuseError(
            f"{call} on a rotated tensor is collective: every rank of its ring must run it, but this rank waited past "
            "hf_rtp's timeout (HF_RTP_TIMEOUT) or lost a peer. Run it on every rank, not under "
            f"`if accelerator.is_main_process:` ({type(err).__name__}: {str(err).splitlines()[0][:300]})"
        ) from err


def _tensors(values):
    """The tensors among an op's arguments, one level into lists (foreach ops take lists of tensors)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _marked_if_rotation(tensor: DTensor) -> DTensor:
    return _marked(tensor) if type(tensor) is DTensor and isinstance(tensor.device_mesh, RotationMesh) else tensor


class _LocalChunk(torch.autograd.Function):
    """`to_local()` of a rotated parameter, whose gradient comes back as a RotatedTensor (DTensor's own
    to_local makes it a plain DTensor, outside any dispatch that could mark it)."""

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.mesh, ctx.placements, ctx.shape, ctx.stride = (
            param.device_mesh,
            param.placements,
            param.shape,
            param.stride(),
        )
        chunk = local_tensor(param)
        return chunk.view_as(chunk)  # a fresh tensor object: autograd writes its metadata into it

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = DTensor.from_local(
            grad.contiguous(), ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape, stride=ctx.stride
        )
        return _marked(grad)


def local_chunk(param: RotatedTensor) -> torch.Tensor:
    """This rank's chunk of a rotated parameter, connected to autograd (see _LocalChunk)."""
    return _LocalChunk.apply(param)


# Foreach kernels (clip_grad_norm_, optimizers) take a tensor class only if it is listed, as torch lists
# DTensor itself (torch/distributed/tensor/__init__.py). Listing this subclass changes nothing for any other.
for _supported in foreach_type_lists:
    if RotatedTensor not in _supported:
        _supported.append(RotatedTensor)


class RowsCopy(RotatedTensor):
    """What indexing a rotated tensor along its rows gives (`w.data[:5]`, `w[7]`): DTensor gathers the rows every
    rank asked for into a replicated copy, where vanilla gives a view. Read it as any tensor; an in-place op on it
    is refused by name (row_edits.py), since it could only change the copy."""

    __slots__ = ()

    def __setitem__(self, key, value) -> None:
        row_edits.refuse_write("an assignment")


def _marked(tensor: DTensor, kind: type = RotatedTensor) -> RotatedTensor:
    tensor.__class__ = kind  # same layout as DTensor; dispatch and nn.Parameter checks unchanged
    return tensor


def make_rotated(param: torch.nn.Parameter) -> torch.nn.Parameter:
    return _marked(param)


def rotated_rows(like: DTensor, rows: torch.Tensor) -> RotatedTensor:
    """This rank's `rows` [its rows of `like`, columns] as a rotated tensor on `like`'s mesh (a quantized weight's
    rows dequantized, say); no communication."""
    shape = torch.Size((like.shape[0], *rows.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return _marked(DTensor.from_local(rows, like.device_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride))


def rotated_scales(param: DTensor, block: int = blockwise.BLOCK) -> RotatedTensor:
    """Zeros for the block scales of a rotated parameter's 8-bit optimizer state (distributed/tensors/blockwise.py)."""
    return _marked(blockwise.zero_scales(param, block))


def keep_rotated(module: torch.nn.Module) -> None:
    """Mark again what `module.to()` / `.float()` unmarked: nn.Module._apply swaps a DTensor parameter
    with a plain DTensor copy (torch.utils.swap_tensors swaps the class too). Without this a Trainer's
    `model.to(device)` would silently restore DTensor's SPMD gradient for full_tensor()."""
    for param in module.parameters():
        if type(param) is DTensor and isinstance(param.device_mesh, RotationMesh):
            make_rotated(param)
