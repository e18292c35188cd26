"""torch's private names hf_rtp uses (DESIGN.md, "Private names"), looked up once when hf_rtp is imported."""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any

import torch
from packaging.version import Version
from torch.distributed.tensor import DTensor

from .gate import lookup

TESTED = ">=2.11,<2.16"  # pyproject.toml's lower bound; newer releases are warned about (gate.py)


def _get(root: Any, path: str) -> Any:
    return lookup(root, path, "torch", torch.__version__, TESTED)


# DTensor's op dispatcher: its `_allow_implicit_replication` flag is toggled around ops on rotated
# tensors only (distributed/tensors/rotated.py)
_op_dispatcher = _get(DTensor, "_op_dispatcher")
_get(_op_dispatcher, "_allow_implicit_replication")


def implicit_replication() -> bool:
    return _op_dispatcher._allow_implicit_replication


def set_implicit_replication(allowed: bool) -> None:
    _op_dispatcher._allow_implicit_replication = allowed


# torch 2.11 dispatches DTensor ops in C++ and skips a subclass's __torch_dispatch__ (#167051: its
# DTensor.__torch_dispatch__ only raises; 2.10 did too, but is below TESTED, so refused above); 2.12 and newer
# call a subclass's again. distributed/tensors/rotated.py then does its work in __torch_function__ instead.
SUBCLASS_DISPATCH_BYPASSED = Version(torch.__version__).release[:2] == (2, 11)
# an op as torch.ops hands it over: one overload, or the packet of them `torch.ops.lib.op(...)` calls
OpOverload = _get(torch._ops, "OpOverload")
OpOverloadPacket = _get(torch._ops, "OpOverloadPacket")
disable_torch_function_subclass = _get(torch._C, "DisableTorchFunctionSubclass")
# GradScaler's unscale as __torch_function__ sees it: torch's function, where __torch_dispatch__ sees amp_unscale
amp_unscale_function = _get(torch, "_amp_foreach_non_finite_check_and_unscale_")


def overload(func: Any) -> Any:
    """An op overload from what __torch_function__ is given for `torch.ops.lib.op(...)`: the packet's default."""
    return func.default if isinstance(func, OpOverloadPacket) else func


# the tensor classes foreach kernels accept (clip_grad_norm_, optimizers); torch lists DTensor there itself
foreach_type_lists = (
    _get(importlib.import_module("torch.optim.optimizer"), "_foreach_supported_types"),
    _get(importlib.import_module("torch.utils._foreach_utils"), "_foreach_supported_types"),
)
# autograd's engine, for the replica sum after `.grad` accumulates (distributed/tensors/replicas.py)
will_engine_execute_node = _get(torch._C, "_will_engine_execute_node")
current_graph_task_id = _get(torch._C, "_current_graph_task_id")
queue_callback = _get(torch.autograd.Variable, "_execution_engine.queue_callback")
# DDP's bucketing helpers, for sync_grads' one all-reduce per dtype (model/data_parallel.py)
flatten_dense_tensors = _get(torch._utils, "_flatten_dense_tensors")
unflatten_dense_tensors = _get(torch._utils, "_unflatten_dense_tensors")
# a device-side check without a host sync (layers/embedding.py, model/fused_head.py,
# distributed/transport/token_walk.py)
_assert_async = _get(torch, "_assert_async")
ASSERT_MESSAGE_LIMIT = 254  # CUDA's `_assert_async` refuses a message of 255 bytes or more; the CPU takes any


def assert_async(condition: torch.Tensor, message: str) -> None:
    """`torch._assert_async(condition, message)`, held to CUDA's limit on every device, so that the CPU suite
    fails on a message the first GPU user would have met as "Message length must be smaller than 255"."""
    if len(message.encode()) > ASSERT_MESSAGE_LIMIT:  # CUDA counts bytes
        raise ValueError(
            f"a device assertion's message is {len(message.encode())} bytes, over CUDA's limit: {message!r}"
        )
    _assert_async(condition, message)


# the attribute DDP reads for the names it must leave alone (model/data_parallel.py)
DDP_IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


_get(torch.Tensor, "_version")


def version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter, shared with its views (distributed/transport/token_walk.py's identities:
    tokens a later op may reuse unchanged)."""
    return tensor._version


def local_tensor(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local shard without autograd's to_local() node (DTensor's own field)."""
    return tensor._local_tensor


# GradScaler's unscale op: DTensor's handler for it reads the placements of the list's first gradient,
# so a replicated (plain) gradient first fails there (distributed/tensors/rotated.py puts a rotated one first)
amp_unscale = _get(torch.ops.aten, "_amp_foreach_non_finite_check_and_unscale_").default
# SDPA's CPU flash kernel and its backward, which return and take the log-sum-exp ring attention merges by
# (layers/attention.py); F.scaled_dot_product_attention returns the output alone
flash_attention_cpu = _get(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu").default
flash_attention_cpu_backward = _get(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward").default
# SDPA's CUDA kernels (flash, memory-efficient, cuDNN) and their backwards, the same for CUDA tensors
# (layers/attention_kernels.py); registered in every build, so a CPU-only torch resolves them too
flash_attention_cuda = _get(torch.ops.aten, "_scaled_dot_product_flash_attention").default
flash_attention_cuda_backward = _get(torch.ops.aten, "_scaled_dot_product_flash_attention_backward").default
efficient_attention = _get(torch.ops.aten, "_scaled_dot_product_efficient_attention").default
efficient_attention_backward = _get(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward").default
cudnn_attention = _get(torch.ops.aten, "_scaled_dot_product_cudnn_attention").default
cudnn_attention_backward = _get(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward").default


def clear_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` no step pre- or post-hooks of its own (torch's global ones are apart): integrations/torchao.py
    steps a shallow copy of an optimizer without them, since they run once, around the real step. The copy gets
    new dicts; the original's are untouched."""
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        _get(optimizer, name)
        setattr(optimizer, name, OrderedDict())


def op_schema(func: Any) -> Any:
    """An op overload's schema (torch._C.FunctionSchema): its qualified name and its arguments' names, which
    distributed/tensors/blockwise.py binds a bitsandbytes update op's arguments by."""
    return _get(func, "_schema")
