"""A frozen nn.Linear quantized to 8 bits by bitsandbytes (LLM.int8(), `load_in_8bit=True`), cut by output features.

bitsandbytes quantizes each row of the weight alone (int8 codes and one float32 absmax per row, from the
float16 weight), so a rank's rows quantized alone are vanilla's, for any cut. A piece is one uint8
row-shaped tensor: the row's int8 codes, then its scale's 4 bytes; it walks the ring whole.

The math is bitsandbytes' own, per piece, in the regime vanilla's Linear8bitLt picks (`bitsandbytes.matmul`):
- training on CPU or XPU (`MatMul8bitFp`): the piece dequantized to the input's dtype, then `F.linear`;
- otherwise (`MatMul8bitLt`): the input quantized to int8 per token once, with `llm_int8_threshold`'s outlier
  columns kept in 16 bits, then `int8_mixed_scaled_mm` (or `int8_scaled_mm` without a threshold) per piece.
  Each output column depends only on its weight row and the whole input, so the pieces give vanilla's columns.
Backward computes only the input gradient, `grad @ dequantized piece`, as both of bitsandbytes' Functions do
(linear4bit.frozen_backward). No weight gradient exists or travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from .common import local, rotate_forward
from .linear4bit import FrozenQuantizedLinear, frozen_backward, joined, split_outputs, stacked_bias

SCALE_BYTES = 4  # float32, one per row


@dataclass(frozen=True)
class Quant8bit:
    """What computing with a piece needs beyond its bytes: `llm_int8_threshold` (outlier columns above it stay
    in 16 bits when the int8 kernel runs; 0 turns the decomposition off)."""

    threshold: float


def quantize_rows8(rows: torch.Tensor) -> torch.Tensor:
    """Rows of a weight [rows, in] -> their piece [rows, in + 4]: bitsandbytes' int8 codes of the float16 rows
    (Int8Params' own quantization), then each row's float32 scale as bytes."""
    codes, scales, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(rows.to(torch.float16), 0.0)
    return torch.cat([codes.view(torch.uint8), scales.contiguous().view(torch.uint8).view(-1, SCALE_BYTES)], dim=1)


def unpack8(piece: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A piece -> its int8 codes [rows, in] and float32 scales [rows]."""
    codes = piece[:, :in_features].contiguous().view(torch.int8)
    scales = piece[:, in_features:].contiguous().view(torch.float32).view(-1)
    return codes, scales


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype).mul_(scales.unsqueeze(1).mul(1.0 / 127.0))  # bitsandbytes' MatMul8bit{Fp,Lt}


class _Rotated8bitFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, ring: Ring, layout: ChunkLayout, module: RotatedLinear8bit, *pieces):
        in_features, threshold = module.in_features, module.threshold
        flat = x.reshape(-1, in_features)
        out = x.new_empty(*x.shape[:-1], layout.rows)
        dequantizing = module.training and x.device.type in ("cpu", "xpu")
        quantized: dict = {}  # the last token set and its int8 codes: quantized once, as bitsandbytes does per call

        def compute(tokens, out, rows, chunk):
            start, end = rows
            (x_j,) = tokens
            codes, scales = unpack8(chunk[0], in_features)
            piece_bias = None if bias is None else bias[start:end]
            if dequantizing:
                out[:, start:end] = torch.nn.functional.linear(x_j, _dequantized(codes, scales, x.dtype), piece_bias)
                return
            if quantized.get("tokens") is not x_j:
                quantized["tokens"] = x_j
                quantized["int8"] = torch.ops.bitsandbytes.int8_vectorwise_quant.default(
                    x_j.to(torch.float16), threshold
                )
            codes_x, scales_x, outliers = quantized["int8"]
            if threshold > 0.0:
                result = torch.ops.bitsandbytes.int8_mixed_scaled_mm.default(
                    x_j, codes_x, codes, scales_x, scales, outliers, piece_bias
                )[0]
            else:
                result = torch.ops.bitsandbytes.int8_scaled_mm.default(
                    codes_x, codes, scales_x, scales, bias=piece_bias, dtype=x.dtype
                )
            out[:, start:end] = result.view(x_j.shape[0], end - start)

        rotate_forward(ring, [joined(pieces)], layout, [flat], [0.0], out.view(-1, layout.rows), compute)
        ctx.save_for_backward(*pieces)
        ctx.ring, ctx.layout, ctx.module = ring, layout, module
        ctx.dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module

        def dequantized(rows, piece):
            return _dequantized(*unpack8(piece, module.in_features), ctx.dtype)

        return frozen_backward(ctx, grad_out, dequantized, ctx.dtype)


class RotatedLinear8bit(FrozenQuantizedLinear):
    """A frozen 8-bit nn.Linear rotated as rows of int8 codes and their scales (see the module's docstring)."""

    spec: Quant8bit

    @property
    def threshold(self) -> float:
        return self.spec.threshold

    def dequantized_piece(self, rows: tuple[int, int], piece: torch.Tensor) -> torch.Tensor:
        codes, scales = unpack8(piece, self.in_features)  # bitsandbytes' int8_vectorwise_dequant, as PEFT reads it
        return torch.ops.bitsandbytes.int8_vectorwise_dequant.default(codes, scales)

    def walk_rows(self, x, modules, layout, stack):
        # bitsandbytes' Linear8bitLt: the bias in the input's dtype, the output in the input's dtype
        columns, order = stack if stack is not None else (None, None)
        bias = stacked_bias(modules, order, x.dtype)
        out = _Rotated8bitFn.apply(x, bias, self.ring, layout, self, *(local(m.weight) for m in modules))
        return split_outputs(out, columns, x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, threshold={self.threshold}"
