"""A diagnosis for the GPU check: print each call of one library's torch ops (name, and each tensor argument's
shape, dtype, strides and device) to stderr before it runs, so that a rank killed in C (SIGSEGV in a library called
through ctypes, where faulthandler's Python stack ends at the op) leaves the arguments of the call that killed it.

On only where `HF_RTP_TRACE_OPS` names the ops' namespace (`HF_RTP_TRACE_OPS=bitsandbytes`): .ci/gpu's qlora stage
runs the test again so when it failed. A TorchDispatchMode sees every op and changes none: what runs is what runs
without it."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return (
            f"T{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} stride={value.stride()} "
            f"offset={value.storage_offset()} {value.device}{'' if value.is_contiguous() else ' NONCONTIG'}"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_described(v) for v in value) + "]"
    return repr(value)


class OpTrace(TorchDispatchMode):
    def __init__(self, namespace: str):
        super().__init__()
        self.namespace = namespace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == self.namespace:
            rank = os.environ.get("RANK", "?")
            described = [_described(a) for a in args] + [f"{k}={_described(v)}" for k, v in kwargs.items()]
            print(f"[op-trace rank {rank}] {func}({', '.join(described)})", file=sys.stderr, flush=True)
        return func(*args, **kwargs)


def from_env() -> contextlib.AbstractContextManager:
    """The trace HF_RTP_TRACE_OPS asks for, or nothing."""
    namespace = os.environ.get("HF_RTP_TRACE_OPS")
    return OpTrace(namespace) if namespace else contextlib.nullcontext()
