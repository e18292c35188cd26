"""Does CUDA's bf16 GEMM round once, as the rotated layers' float32 sums assume? (GPU run 13: under autocast the
layers' input gradients still differ from vanilla's on CUDA, where on the CPU they match to 6.5e-8.)

A rotated linear's input gradient is sum_c g[:, c] @ W[c] over the ring's chunks of W's rows: each partial in float32
(`torch.mm(..., out_dtype=torch.float32)`, layers/common.py's matmul_float32), summed in float32, rounded to bf16
once. Vanilla's is one `g @ W` in bf16. Both are compared here with the exact answer rounded once (float64 GEMM,
then bf16), with torch's `allow_bf16_reduced_precision_reduction` on (its default) and off: where vanilla's own
GEMM rounds more than once (split-K reduced in bf16), no decomposition matches it bit for bit.

    bash .ci/gpu-device python3 tests/gpu/probe_bf16_sums.py     # on a lent GPU, a few seconds
    python tests/gpu/probe_bf16_sums.py --device cpu             # the same on the CPU (upcast fallback)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from hf_rtp.layers.common import matmul_float32

SHAPES = [(2048, 512, 256), (2048, 256, 256), (4096, 8192, 2048), (4096, 2048, 8192)]  # tokens, out (summed), in


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(share of entries that differ, relative L2 gap)"""
    a, b = a.double(), b.double()
    return (a != b).double().mean().item(), ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def probe(device: str, chunks: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    for tokens, out, inp in SHAPES:
        g = torch.randn(tokens, out, generator=gen).to(device, torch.bfloat16)
        w = (torch.randn(out, inp, generator=gen) / out**0.5).to(device, torch.bfloat16)
        exact = (g.double() @ w.double()).to(torch.bfloat16)
        bounds = [(c * out // chunks, (c + 1) * out // chunks) for c in range(chunks)]
        for reduced in (True, False):
            if device.startswith("cuda"):
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
            vanilla = g @ w
            summed = torch.zeros(tokens, inp, dtype=torch.float32, device=device)
            for lo, hi in bounds:
                summed += matmul_float32(g[:, lo:hi], w[lo:hi])
            rotated = summed.to(torch.bfloat16)
            print(
                f"{tokens}x{out}x{inp} reduced={reduced!s:5}  vanilla/exact {_gap(vanilla, exact)[0]:.4f} differ "
                f"({_gap(vanilla, exact)[1]:.2e})  rotated/exact {_gap(rotated, exact)[0]:.4f} "
                f"({_gap(rotated, exact)[1]:.2e})  rotated/vanilla {_gap(rotated, vanilla)[0]:.4f} "
                f"({_gap(rotated, vanilla)[1]:.2e})"
            )


def attention(device: str) -> None:
    """The other suspect: a stacked q/k/v walk hands SDPA views into one output (strided), vanilla separate
    contiguous tensors; on CUDA SDPA may pick another kernel for another layout. Outputs and input gradients of both,
    in bf16 (as under autocast), beside each other."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch, heads, seq, dim = 2, 4, 1024, 64
    x = torch.randn(batch, seq, heads * dim, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(3 * heads * dim, heads * dim, generator=gen) / (heads * dim) ** 0.5).to(device, torch.bfloat16)
    grad = torch.randn(batch, heads, seq, dim, generator=gen).to(device, torch.bfloat16)
    results = []
    for stacked in (False, True):
        if stacked:  # one matmul, three views (layers/stacked.py's output)
            qkv = (x @ w.T).requires_grad_()
            q, k, v = qkv.split(heads * dim, dim=-1)
        else:
            q, k, v = (x @ part.T for part in w.split(heads * dim))
            q, k, v = (t.contiguous().requires_grad_() for t in (q, k, v))
        leaves = [qkv] if stacked else [q, k, v]
        heads_ = [t.view(batch, seq, heads, dim).transpose(1, 2) for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*heads_, is_causal=True)
        out.backward(grad)
        grads = leaves[0].grad.split(heads * dim, dim=-1) if stacked else [t.grad for t in leaves]
        results.append((out.detach(), torch.cat([g.reshape(-1) for g in grads])))
    (o0, g0), (o1, g1) = results
    print(
        f"attention (SDPA's default choice): stacked/separate output {_gap(o1, o0)[0]:.4f} differ "
        f"({_gap(o1, o0)[1]:.2e}), q/k/v gradients {_gap(g1, g0)[0]:.4f} ({_gap(g1, g0)[1]:.2e})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--chunks", type=int, default=2)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA here: --device cpu")
    print(f"torch {torch.__version__} on {args.device}, {args.chunks} chunks of the summed dimension")
    probe(args.device, args.chunks)
    attention(args.device)


if __name__ == "__main__":
    main()
