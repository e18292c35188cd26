"""A frozen nn.Linear quantized to 4 bits by bitsandbytes (QLoRA's base), cut by output features.

Why a rank can quantize its own rows: bitsandbytes quantizes the flattened weight in blocks of
`blocksize` consecutive elements, each with its own absmax. When `in_features` is a multiple of the
block size every block lies inside one row, so a rank's rows quantized alone give the same packed
bytes and scales as the whole tensor quantized at once (vanilla's Linear4bit), for any cut.

A rank holds its rows as one uint8 tensor of `in_features / 2` packed bytes, then the rows' float32
absmax (`in_features / blocksize` of them) as bytes: that row-shaped piece is what walks the ring, the
scales with the data. The bias stays an ordinary parameter, whole on every rank as vanilla's is (frozen
unless PEFT trains it: bias="all"). Double quantization (`bnb_4bit_use_double_quant`)
compresses the absmax again with an offset that is the mean over the whole tensor; hf_rtp computes it
as vanilla does (on the gathered absmax, `quantize_double`) and keeps the float32 absmax it dequantizes
to, the exact values vanilla's matmul uses. The cost is vanilla's 0.016 bytes of scales per parameter
becoming 0.0625.

The math is bitsandbytes' own, per piece: forward calls `bitsandbytes::gemm_4bit` on each held piece
(vanilla's Linear4bit calls it on the whole weight; each output row depends only on its weight row), with
the input cast to the compute dtype as Linear4bit casts it; backward computes only the input gradient,
`grad @ dequantize_4bit(piece)`, as bitsandbytes' MatMul4Bit does. No weight gradient exists or travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from .common import add_matmul_summed, local, rotate_forward, sum_dtype
from .linear import RotatedLinear

ABSMAX_BYTES = 4  # float32
BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which transformers' Linear4bit uses


@dataclass(frozen=True)
class Quant4bit:
    """What bitsandbytes needs to compute with a piece: bnb_4bit_quant_type, the block size, the dtype the
    weight was quantized from (dequantize returns it) and bnb_4bit_compute_dtype (None: the input's)."""

    quant_type: str
    blocksize: int
    dtype: torch.dtype
    compute_dtype: torch.dtype | None


def packed_columns(in_features: int, spec: Quant4bit) -> int:
    """Bytes per row of a piece: packed data, then absmax."""
    return in_features // 2 + in_features // spec.blocksize * ABSMAX_BYTES


def quantize_rows(rows: torch.Tensor, spec: Quant4bit) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a weight [rows, in] (in spec.dtype) -> their packed bytes [rows, in / 2] and float32 absmax
    [rows, in / blocksize], exactly what quantizing the whole weight gives for these rows."""
    packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(rows, spec.blocksize, spec.quant_type, torch.uint8)
    n = rows.shape[0]
    return packed.view(n, -1), absmax.view(n, -1)


def quantize_double(absmax: torch.Tensor) -> torch.Tensor:
    """The absmax values vanilla's matmul sees under double quantization: bitsandbytes' quantize_4bit
    (compress_statistics=True) on the whole tensor's absmax, then dequantize_4bit's first step."""
    import bitsandbytes.functional as bnb_functional

    flat = absmax.reshape(-1)
    offset = flat.mean()
    quantized, state2 = bnb_functional.quantize_blockwise(flat - offset, blocksize=256)
    restored = bnb_functional.dequantize_blockwise(quantized, state2)
    restored += offset
    return restored.float().view_as(absmax)


def piece_of(packed: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """One uint8 row-shaped tensor: packed data, then absmax bytes."""
    return torch.cat([packed, absmax.contiguous().view(torch.uint8).view(packed.shape[0], -1)], dim=1)


def joined(pieces: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """This rank's piece of a walk: one layer's own, or its stacked siblings' in turn (layers/siblings.py; a copy,
    made once per walk and again in backward, never saved)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def stacked_bias(modules: list, order: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole biases of `modules` (replicated, as vanilla holds them) in `dtype`, in the stacked rows' order
    (`order`: the position in their concatenation of each stacked row; None: one module). Built by differentiable
    ops, so a bias PEFT trains (bias="all") gets its gradient through the stack."""
    if modules[0].bias is None:
        return None
    if order is None:
        return local(modules[0].bias).to(dtype)
    return torch.cat([local(m.bias).to(dtype) for m in modules]).index_select(0, order)


def split_outputs(out: torch.Tensor, columns: list[torch.Tensor] | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each module's output in `dtype`: the whole of `out`, or each one's columns of the stacked output."""
    if columns is None:
        return [out.to(dtype)]
    return [out.index_select(-1, cols).to(dtype) for cols in columns]


class _Rotated4bitFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, ring: Ring, layout: ChunkLayout, module: RotatedLinear4bit, *pieces):
        out = x.new_empty(*x.shape[:-1], layout.rows)

        def compute(tokens, out, rows, chunk):
            start, end = rows
            packed, absmax = module.unpack(chunk[0])
            out[:, start:end] = torch.ops.bitsandbytes.gemm_4bit.default(
                tokens[0], packed, (end - start, module.in_features), absmax, module.spec.blocksize,
                module.spec.quant_type, bias=None if bias is None else bias[start:end],
            )  # fmt: skip

        own = [joined(pieces)]
        rotate_forward(ring, own, layout, [x.reshape(-1, x.shape[-1])], [0.0], out.view(-1, layout.rows), compute)
        ctx.save_for_backward(*pieces)
        ctx.ring, ctx.layout, ctx.module = ring, layout, module
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return frozen_backward(ctx, grad_out, ctx.module.dequantized_piece, grad_out.dtype)


def frozen_backward(ctx, grad_out, dequantized, dtype: torch.dtype):
    """The backward of a frozen quantized linear on the ring (bitsandbytes' MatMul4Bit and MatMul8bit{Fp,Lt}): the
    bias's gradient, the sum over tokens in its dtype; the input's, `grad @ dequantized(rows, piece)` over the
    walk, in `dtype`. No weight gradient exists or travels. The Functions' inputs: x, bias, ring, layout, module,
    then the pieces (one, or stacked siblings' in turn)."""
    pieces = ctx.saved_tensors
    rest = (None,) * (3 + len(pieces))
    grad_bias = None
    if ctx.needs_input_grad[1]:
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=ctx.bias_dtype)
    if not ctx.needs_input_grad[0]:
        return None, grad_bias, *rest
    g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
    # a sum over the walk's pieces: in float32 for bf16 or fp16, each piece's partial unrounded, rounded to `dtype`
    # once at the end, as bitsandbytes' one matmul over the whole dequantized weight rounds
    grad_x = g2.new_zeros(g2.shape[0], ctx.module.in_features, dtype=sum_dtype(dtype))

    def input_grad(rows, chunk):
        weight = dequantized(rows, chunk[0]).to(dtype)
        add_matmul_summed(grad_x, g2[:, rows[0] : rows[1]], weight)

    ctx.ring.backward_walk([joined(pieces)], ctx.layout, None, input_grad)
    # the width named: a rank that brought no tokens (context parallelism's uneven cut) has 0 elements to infer from
    return grad_x.to(dtype).view(*grad_out.shape[:-1], ctx.module.in_features), grad_bias, *rest


class _DequantizedFn(torch.autograd.Function):
    """`F.linear(x, W)` with W the layer's dequantized weight, piece by piece over the ring, in x's dtype; backward
    the input gradient only. What PEFT's DoRA computes on vanilla's dequantized weight when lora_dropout drops the
    input (DoraLinearLayer.forward, `base_result=None`)."""

    @staticmethod
    def forward(ctx, x, bias, ring: Ring, layout: ChunkLayout, module: FrozenQuantizedLinear, piece):
        out = x.new_empty(*x.shape[:-1], layout.rows)

        def compute(tokens, out, rows, chunk):
            out[:, rows[0] : rows[1]] = torch.nn.functional.linear(
                tokens[0], module.dequantized_piece(rows, chunk[0]).to(x.dtype)
            )

        rotate_forward(ring, [piece], layout, [x.reshape(-1, x.shape[-1])], [0.0], out.view(-1, layout.rows), compute)
        ctx.save_for_backward(piece)
        ctx.ring, ctx.layout, ctx.module, ctx.bias_dtype = ring, layout, module, None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return frozen_backward(ctx, grad_out, ctx.module.dequantized_piece, grad_out.dtype)


class FrozenQuantizedLinear(RotatedLinear):
    """A rotated linear whose weight is quantized bytes (4-bit here, 8-bit in linear8bit.py): `weight` is this
    layer's pieces as a uint8 Shard(0) DTensor [out_features, bytes per row], not bitsandbytes' Params4bit or
    Int8Params; it never trains, and hf_rtp does not save it (save the adapter). `bias` is whole, as vanilla's,
    and frozen, as transformers freezes the whole quantized Linear."""

    def __init__(self, source: RotatedLinear, *, spec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = source.weight
        self.bias = source.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.ring, self.spec = source.ring, spec
        self.layout = ChunkLayout((self.weight.shape,), self.ring.size)
        self.bias_after_matmul = False

    def dequantized_piece(self, rows: tuple[int, int], piece: torch.Tensor) -> torch.Tensor:
        """A piece's rows of the weight as PEFT's `dequantize_bnb_weight` gives vanilla's whole weight (DoRA)."""
        raise NotImplementedError

    def walk_rows(
        self, x: torch.Tensor, modules: list, layout: ChunkLayout, stack: tuple[list[torch.Tensor], torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """This layer's outputs for `x` by one walk: its own (`modules` [self], `layout` its own, `stack` None), or
        every one of `modules`' (its siblings of one kind, layers/siblings.py) with their pieces stacked over
        `layout` (distributed/tensors/sharding.py's StackedLayout; `stack`: each one's columns of it and the order of
        their biases' rows): one hop and one bitsandbytes matmul per chunk for all of them."""
        raise NotImplementedError

    def walk_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as this kind's walk computes with it (layers/siblings.py decides by it, as the walk will)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        siblings = self.__dict__.get("siblings")  # layers.siblings: q, k and v on the same tokens, walked stacked
        if siblings is not None:
            found = siblings.forward(self, x)
            if found is not None:
                return found
        return self.walk_rows(x, [self], self.layout, None)[0]

    def dequantized_rows(self) -> torch.Tensor:
        """This rank's rows of the dequantized weight (no communication)."""
        piece = local(self.weight)
        return self.dequantized_piece((0, piece.shape[0]), piece)

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, dequantized weight)` without the bias, in x's dtype, over the ring (_DequantizedFn)."""
        return _DequantizedFn.apply(x, None, self.ring, self.layout, self, local(self.weight))


class RotatedLinear4bit(FrozenQuantizedLinear):
    """A frozen 4-bit nn.Linear rotated as packed rows with their scales (see the module's docstring)."""

    spec: Quant4bit

    def dequantized_piece(self, rows: tuple[int, int], piece: torch.Tensor) -> torch.Tensor:
        packed, absmax = self.unpack(piece)  # bitsandbytes' dequantize_4bit, in the dtype it was quantized from
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            packed, absmax, self.spec.blocksize, self.spec.quant_type, (rows[1] - rows[0], self.in_features),
            self.spec.dtype,
        )  # fmt: skip

    def unpack(self, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.in_features // 2
        packed = piece[:, :data].contiguous().view(-1, 1)
        absmax = piece[:, data:].contiguous().view(torch.float32).view(-1)
        return packed, absmax

    def walk_input(self, x: torch.Tensor) -> torch.Tensor:
        # bitsandbytes' Linear4bit: the input in bnb_4bit_compute_dtype (or its own float32/bf16)
        compute = self.spec.compute_dtype
        if compute is None and x.dtype in (torch.float32, torch.bfloat16):
            compute = x.dtype
        return x if compute is None else x.to(compute)

    def walk_rows(self, x, modules, layout, stack):
        # the bias in the compute dtype, the output back in the input's dtype
        dtype = x.dtype
        x = self.walk_input(x)
        columns, order = stack if stack is not None else (None, None)
        bias = stacked_bias(modules, order, x.dtype)
        out = _Rotated4bitFn.apply(x, bias, self.ring, layout, self, *(local(m.weight) for m in modules))
        return split_outputs(out, columns, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quant_type={self.spec.quant_type}, blocksize={self.spec.blocksize}"
        )
