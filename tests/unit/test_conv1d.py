"""GPT-2's Conv1D rotated (layers/conv1d.py) on a ring of one, against transformers' Conv1D in the same process:
the output and every gradient, its explicit backward by finite differences, bf16 autocast over float32 weights,
a frozen weight (a LoRA base), and which Conv1D modules the conv1d kind takes. Uneven chunks and the partial sums
over several ranks are tests/distributed's (GPT-2 at 2 and 3 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_rtp.distributed.tensors.sharding import ChunkLayout
from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.layers import LAYERS, RotatedConv1D
from hf_rtp.layers.conv1d import _RotatedConv1DFn


def _pair(nf=12, nx=8, dtype=torch.float64):
    torch.manual_seed(0)
    vanilla = Conv1D(nf, nx).to(dtype)
    with torch.no_grad():
        vanilla.bias.normal_()  # transformers initialises it to zeros
    source = copy.deepcopy(vanilla)
    rotated = RotatedConv1D(source, ring=Ring(None), weight=source.weight, bias=source.bias)
    return rotated, vanilla


def test_it_stays_a_conv1d_with_vanillas_names_and_shapes():
    rotated, vanilla = _pair()
    assert isinstance(rotated, Conv1D) and (rotated.nf, rotated.nx) == (vanilla.nf, vanilla.nx)
    assert [(n, p.shape) for n, p in rotated.named_parameters()] == [
        (n, p.shape) for n, p in vanilla.named_parameters()
    ]


def test_output_and_every_gradient_equal_vanillas():
    rotated, vanilla = _pair()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = rotated(ours), vanilla(theirs)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours.grad, theirs.grad)
    for name, param in rotated.named_parameters():
        torch.testing.assert_close(param.grad, vanilla.get_parameter(name).grad, msg=name)


def test_backward_by_gradcheck():
    ring = Ring(None)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)  # [in, out]: cut by input features
    layout = ChunkLayout((w.shape,), 1)
    assert torch.autograd.gradcheck(lambda x, w: _RotatedConv1DFn.apply(x, w, ring, layout), (x, w))


def test_a_frozen_weight_still_passes_the_inputs_gradient():
    rotated, vanilla = _pair()
    for module in (rotated, vanilla):
        module.weight.requires_grad_(False)
    x = torch.randn(3, 8, dtype=torch.float64)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    rotated(ours).sum().backward()
    vanilla(theirs).sum().backward()
    assert rotated.weight.grad is None and vanilla.weight.grad is None
    torch.testing.assert_close(ours.grad, theirs.grad)
    torch.testing.assert_close(rotated.bias.grad, vanilla.bias.grad)


def test_bf16_autocast_over_float32_weights_is_vanillas_within_bf16_rounding():
    rotated, vanilla = _pair(dtype=torch.float32)
    x = torch.randn(4, 8)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = rotated(ours), vanilla(theirs)
    assert out.dtype == expected.dtype == torch.bfloat16
    # vanilla's addmm adds the bias inside the product's rounding, ours after it: one bf16 rounding apart
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for name, param in rotated.named_parameters():
        theirs_grad = vanilla.get_parameter(name).grad
        assert param.grad.dtype == theirs_grad.dtype == torch.float32, name
        torch.testing.assert_close(param.grad, theirs_grad, rtol=2e-2, atol=2e-2 * theirs_grad.abs().max().item())


class _Scaled(Conv1D):
    def forward(self, x):
        return super().forward(x) * 2


class _Named(Conv1D):
    """A subclass that keeps Conv1D's forward (a marker class, say)."""


@pytest.mark.parametrize(
    "module, refusal",
    [
        (Conv1D(4, 3), None),
        (_Named(4, 3), None),
        (_Scaled(4, 3), "_Scaled overrides Conv1D.forward, which hf_rtp does not reproduce"),
        (nn.Linear(3, 4), "it is not a Conv1D"),
    ],
    ids=["Conv1D", "subclass", "own forward", "Linear"],
)
def test_the_kind_takes_a_conv1d_whose_forward_is_conv1ds(module, refusal):
    assert LAYERS["conv1d"].refusal(module) == refusal
