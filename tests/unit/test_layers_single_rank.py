"""The rotated ops' explicit backward checked by finite differences on a ring of one."""

import torch
import torch.nn.functional as F
from torch import nn

from hf_rtp.distributed.tensors.sharding import ChunkLayout
from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.layers import RotatedEmbedding, RotatedLinear
from hf_rtp.layers.embedding import _RotatedEmbeddingFn
from hf_rtp.layers.linear import _RotatedLinearFn


def test_linear_backward_by_gradcheck():
    ring = Ring(None)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    layout = ChunkLayout((w.shape, b.shape), 1)
    assert torch.autograd.gradcheck(lambda x, w, b: _RotatedLinearFn.apply(x, w, b, ring, layout), (x, w, b))
    torch.testing.assert_close(_RotatedLinearFn.apply(x, w, b, ring, layout), F.linear(x, w, b))


def test_embedding_backward_skips_padding_row_like_vanilla():
    ring = Ring(None)
    vanilla = nn.Embedding(11, 4, padding_idx=3).double()
    rotated = RotatedEmbedding(vanilla, ring=ring, weight=nn.Parameter(vanilla.weight.detach().clone()))
    ids = torch.tensor([[3, 1, 3, 10], [0, 1, 2, 3]])
    out, ref = rotated(ids), vanilla(ids)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(rotated.weight.grad, vanilla.weight.grad)
    assert rotated.weight.grad[3].abs().sum() == 0
    layout = ChunkLayout((vanilla.weight.shape,), 1)
    w = vanilla.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda w: _RotatedEmbeddingFn.apply(ids, w, ring, layout, None), (w,))


def test_rotated_modules_keep_vanilla_identity():
    ring = Ring(None)
    lin = nn.Linear(5, 4, bias=False)
    rotated = RotatedLinear(lin, ring=ring, weight=lin.weight)
    assert isinstance(rotated, nn.Linear) and (rotated.in_features, rotated.out_features) == (5, 4)
    assert [n for n, _ in rotated.named_parameters()] == ["weight"]
