"""A diagnosis for the GPU check's qlora stage (.ci/gpu runs it when that stage failed): bitsandbytes' gemm_4bit on
CUDA, alone, at the shapes a ring gives it (a chunk's rows of a weight: N of 8 to 128 rows, K 64 and 128, M tokens
from 1 to 1600, bf16, fp16 and float32 inputs, with and without a bias) and at vanilla's (the whole weight), each
against dequantize_4bit + F.linear on the same device. Each case is printed before it runs, so a process killed in
C names the case that killed it; a wrong result is printed with its gap. Exits 1 when any case is off.

    python tests/gpu/probe_gemm4bit.py [cpu]   # (on a CPU: the probe's own check)
"""

from __future__ import annotations

import sys

import torch


def main(device: str = "cuda") -> int:
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    ops = torch.ops.bitsandbytes
    torch.manual_seed(0)
    off = 0
    for k in (64, 128):
        whole = torch.randn(128, k, device=device)
        for n in (128, 64, 32, 16, 8):  # vanilla's whole weight first, then a chunk's rows
            rows = whole[:n].contiguous()
            packed, absmax = ops.quantize_4bit.default(rows, 64, "nf4", torch.uint8)
            weight = ops.dequantize_4bit.default(packed, absmax, 64, "nf4", (n, k), torch.float32)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for m in (1, 4, 5, 8, 24, 100, 1600):
                    for bias in (None, torch.randn(n, device=device, dtype=dtype)):
                        x = torch.randn(m, k, device=device, dtype=dtype)
                        case = f"N={n} K={k} M={m} {str(dtype).removeprefix('torch.')} bias={bias is not None}"
                        print(f"gemm_4bit {case} ...", end=" ", flush=True)
                        out = ops.gemm_4bit.default(x, packed, (n, k), absmax, 64, "nf4", bias=bias)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        expected = torch.nn.functional.linear(x, weight.to(dtype), bias)
                        gap = (out.float() - expected.float()).abs().max().item()
                        scale = expected.float().abs().max().item()
                        ok = gap <= 3e-2 * scale
                        off += not ok
                        print(f"{'ok' if ok else 'OFF'} (gap {gap:.3g} of {scale:.3g})", flush=True)
    print(f"probe_gemm4bit: {off} case(s) off", flush=True)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
