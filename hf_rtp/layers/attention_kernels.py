"""The SDPA kernels ring attention calls: each returns a block's output with its log-sum-exp, and has a backward op.

Ring attention merges the blocks of keys it sees by their log-sum-exp, so it calls SDPA's fused kernels directly
rather than `F.scaled_dot_product_attention` (which returns the output alone), and picks one as SDPA picks for the
device, dtype and head size, in torch's default priority:

| kernel | aten op (torch 2.13) | where, dtypes | heads | GQA | log-sum-exp as returned |
|---|---|---|---|---|---|
| flash | `_scaled_dot_product_flash_attention` | CUDA sm80+; fp16, bf16 | <= 256 | yes | [B, H, Sq] fp32 |
| efficient | `_scaled_dot_product_efficient_attention` | CUDA; fp32 (half: as fp32) | any | no | [B, H, Sq to 32n] |
| cudnn | `_scaled_dot_product_cudnn_attention` | CUDA sm80+ cuDNN 9; fp16, bf16 | <= 128 | no | [B, H, Sq, 1] fp32 |
| cpu flash | `_scaled_dot_product_flash_attention_for_cpu` | CPU; fp16-fp64 | any | if taken | [B, H, Sq] fp32, fp64 |

Every kernel's log-sum-exp is normalised here, in one place, to [batch, heads, queries] in the merge dtype (float32,
float64 for float64 inputs), and given back to its backward in the layout that backward reads. Head sizes are
padded with zero columns to a multiple of 8 on CUDA (the fused kernels' alignment; a zero column changes no dot
product, and the scale is always passed). SDPA's math kernel returns no log-sum-exp: ring attention never uses it.
`torch.backends.cuda.flash_sdp_enabled()`, `mem_efficient_sdp_enabled()` and `cudnn_sdp_enabled()` (a user's
`sdpa_kernel` context) are respected; the CPU flash kernel answers to the flash switch, as SDPA's own does.

The backward ops take the forward's philox seed and offset (dropout is always 0 here: they are placeholders the
kernels carry) and cumulative lengths (undefined for dense inputs) back; `Aux` keeps what a block's forward returned.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import SettingError
from ..private import torch_names as ops

Aux = tuple[Any, ...]
"""what a kernel's forward returned besides its output and log-sum-exp, which its backward takes back"""

BACKENDS = ("flash", "efficient", "cudnn")
"""SDPA's backends that return a log-sum-exp, by the switches that enable them"""


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """What blocks are merged (and dQ, dK, dV summed) in: float32 for half inputs, as the kernels accumulate."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(frozen=True)
class Kernel:
    """One SDPA kernel: what it takes (a pure description, for `choose`) and how it is called."""

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    max_head: int | None
    """the widest head it takes (after padding); None: any"""
    multiple: int
    """head sizes are padded with zero columns to a multiple of this"""
    grouped: bool
    """takes fewer K/V heads than query heads (GQA) and returns dK, dV at the K/V heads"""
    capability: tuple[int, int] = (0, 0)
    """the oldest CUDA compute capability it runs on"""

    def width(self, head: int) -> int:
        """The head size the kernel is called with for queries and keys of `head` (values widened to it)."""
        return -(-head // self.multiple) * self.multiple

    def unfit(self, dtype: torch.dtype, head: int, capability: tuple[int, int] | None) -> str | None:
        """Why the kernel does not take heads of `head` in `dtype` on a device of `capability`; None when it does."""
        if dtype not in self.dtypes:
            return f"no {str(dtype).removeprefix('torch.')}"
        if self.max_head is not None and self.width(head) > self.max_head:
            return f"heads of at most {self.max_head}"
        if capability is not None and capability < self.capability:
            return f"compute capability {self.capability[0]}.{self.capability[1]} or newer"
        if capability is not None and dtype == torch.bfloat16 and capability < (8, 0):
            return "no bfloat16 before compute capability 8.0"
        if self.name == "flash" and capability in ((8, 6), (8, 9)) and self.width(head) > 192:
            return "no backward for heads over 192 on compute capability 8.6 and 8.9"  # SDPA's own rule there
        return None

    def forward(self, q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor, Aux]:
        """(output [B, H, Sq, D], log-sum-exp [B, H, Sq] in the merge dtype, what the backward takes back)."""
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, aux: Aux, causal: bool, scale) -> tuple[torch.Tensor, ...]:
        """(dQ, dK, dV) of one block given the merged output and log-sum-exp (lse: [B, H, Sq], merge dtype)."""
        raise NotImplementedError


def normalised_lse(lse: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """Any kernel's log-sum-exp as [batch, heads, queries] in the merge dtype: the one normalisation. The efficient
    kernel pads its queries to a multiple of 32, cuDNN keeps a trailing dim of 1."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :queries].to(merge_dtype(dtype))


class _CpuFlash(Kernel):
    def forward(self, q, k, v, causal, scale):
        out, lse = ops.flash_attention_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, normalised_lse(lse, q.shape[2], q.dtype), ()

    def backward(self, grad_out, q, k, v, out, lse, aux, causal, scale):
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
        return ops.flash_attention_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


class _Flash(Kernel):
    def forward(self, q, k, v, causal, scale):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = ops.flash_attention_cuda(
            query=q, key=k, value=v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale
        )
        return out, normalised_lse(lse, q.shape[2], q.dtype), (cum_q, cum_k, seed, offset)

    def backward(self, grad_out, q, k, v, out, lse, aux, causal, scale):
        cum_q, cum_k, seed, offset = aux
        return ops.flash_attention_cuda_backward(
            grad_out=grad_out, query=q, key=k, value=v, out=out, logsumexp=lse.float().contiguous(),
            cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=q.shape[2], max_k=k.shape[2], dropout_p=0.0, is_causal=causal,
            philox_seed=seed, philox_offset=offset, scale=scale,
        )  # fmt: skip


class _Efficient(Kernel):
    # Half inputs run in float32. In fp16 and bf16 this kernel's backward gave wrong dQ and dK for ring blocks
    # (off by their whole size, NaN at times, run to run), where its output and dV were right and float32 was
    # exact: .ci/gpu on an H100, torch 2.11 (benchmarks/results/gpu-check-h100-run2.log). Float32 costs this
    # kernel more memory and time per block (not measured). Flash, which comes first for half precision, and cuDNN
    # keep theirs; this kernel is picked for half inputs where flash is switched off or does not fit.
    def forward(self, q, k, v, causal, scale):
        out, lse, seed, offset = ops.efficient_attention(
            query=q.float(), key=k.float(), value=v.float(), attn_bias=None, compute_log_sumexp=True, dropout_p=0.0,
            is_causal=causal, scale=scale,
        )  # fmt: skip
        return out, normalised_lse(lse, q.shape[2], q.dtype), (seed, offset)

    def backward(self, grad_out, q, k, v, out, lse, aux, causal, scale):
        seed, offset = aux
        # its backward reads the log-sum-exp as its forward wrote it: queries padded to a multiple of 32
        padded = F.pad(lse.float(), (0, -lse.shape[-1] % 32)).contiguous()
        dq, dk, dv, _ = ops.efficient_attention_backward(
            grad_out_=grad_out.float(), query=q.float(), key=k.float(), value=v.float(), attn_bias=None,
            out=out.float(), logsumexp=padded, philox_seed=seed, philox_offset=offset, dropout_p=0.0,
            grad_input_mask=[True, True, True, False], is_causal=causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class _Cudnn(Kernel):
    # cuDNN builds its graph from the tensors' strides: every tensor goes in contiguous, the log-sum-exp [B, H, Sq, 1]
    def forward(self, q, k, v, causal, scale):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = ops.cudnn_attention(
            query=q.contiguous(), key=k.contiguous(), value=v.contiguous(), attn_bias=None, compute_log_sumexp=True,
            dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale,
        )  # fmt: skip
        return out, normalised_lse(lse, q.shape[2], q.dtype), (cum_q, cum_k, seed, offset)

    def backward(self, grad_out, q, k, v, out, lse, aux, causal, scale):
        cum_q, cum_k, seed, offset = aux
        return ops.cudnn_attention_backward(
            grad_out=grad_out.contiguous(), query=q.contiguous(), key=k.contiguous(), value=v.contiguous(),
            out=out.contiguous(), logsumexp=lse.float().unsqueeze(-1).contiguous(), philox_seed=seed,
            philox_offset=offset, attn_bias=None, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=q.shape[2],
            max_k=k.shape[2], dropout_p=0.0, is_causal=causal, scale=scale,
        )  # fmt: skip


_HALF = (torch.float16, torch.bfloat16)
FLASH = _Flash("flash", "cuda", _HALF, 256, 8, grouped=True, capability=(8, 0))
EFFICIENT = _Efficient("efficient", "cuda", (*_HALF, torch.float32), None, 8, grouped=False, capability=(5, 0))
CUDNN = _Cudnn("cudnn", "cuda", _HALF, 128, 8, grouped=False, capability=(8, 0))
CPU_FLASH = _CpuFlash("cpu flash", "cpu", (*_HALF, torch.float32, torch.float64), None, 1, grouped=False)
KERNELS = {"cpu": (CPU_FLASH,), "cuda": (FLASH, EFFICIENT, CUDNN)}
"""by device type, in SDPA's default priority (its math kernel, between efficient and cuDNN, has no log-sum-exp)"""
_SWITCH = {"cpu flash": "flash", "flash": "flash", "efficient": "efficient", "cudnn": "cudnn"}


def choose(
    device_type: str,
    dtype: torch.dtype,
    head: int,
    enabled: Collection[str] = BACKENDS,
    capability: tuple[int, int] | None = None,
) -> Kernel:
    """The kernel SDPA would pick for heads of `head` (queries' and keys'; values are widened to it) in `dtype` on
    `device_type`, among the `enabled` backends (names of BACKENDS) on a device of CUDA `capability` (None: not
    known, not checked). SettingError naming the shapes, dtype and each kernel's reason when none fits."""
    kernels = KERNELS.get(device_type)
    if kernels is None:
        raise SettingError(
            f"context parallelism: ring attention has kernels for cpu and cuda tensors, not {device_type}"
        )
    reasons = []
    for kernel in kernels:
        why = "disabled (torch.backends.cuda / sdpa_kernel)" if _SWITCH[kernel.name] not in enabled else None
        why = why or kernel.unfit(dtype, head, capability)
        if why is None:
            return kernel
        reasons.append(f"{kernel.name}: {why}")
    raise SettingError(
        f"context parallelism: no attention kernel that returns its log-sum-exp takes {dtype} heads of {head} on "
        f"{device_type} ({'; '.join(reasons)}). Ring attention merges blocks by their log-sum-exp, which SDPA's math "
        "kernel does not return: enable one of these kernels, or change the dtype"
    )


def enabled_backends() -> frozenset[str]:
    """The backends SDPA may use now (torch.backends.cuda's switches, set by `sdpa_kernel`); cuDNN's also needs
    cuDNN 9, which its fused attention came with."""
    cuda = torch.backends.cuda
    on = {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled()}
    cudnn = torch.backends.cudnn
    on["cudnn"] = cuda.cudnn_sdp_enabled() and cudnn.is_available() and (cudnn.version() or 0) >= 90000
    return frozenset(name for name, yes in on.items() if yes)


def kernel_for(device: torch.device, dtype: torch.dtype, head: int) -> Kernel:
    """`choose` for a device now: its compute capability and the backends enabled."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose(device.type, dtype, head, enabled_backends(), capability)


def takes_groups(kernel: Kernel) -> bool:
    """Whether `kernel` is called with fewer K/V heads than query heads (else they are repeated as repeat_kv
    does). The CPU kernel takes them in the torch releases that taught it GQA: tried once, on one token."""
    return kernel.grouped or (kernel is CPU_FLASH and _cpu_takes_groups())


@functools.cache
def _cpu_takes_groups() -> bool:
    q = torch.zeros(1, 2, 1, 8)
    k = torch.zeros(1, 1, 1, 8)
    try:
        out, lse = ops.flash_attention_cpu(q, k, k, 0.0, False)
        grads = ops.flash_attention_cpu_backward(out, q, k, k, out, lse.contiguous(), 0.0, False)
    except RuntimeError:
        return False
    return out.shape == q.shape and grads[1].shape == k.shape
