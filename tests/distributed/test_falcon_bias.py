"""FalconLinear writes `input @ W.T + bias` out. Under bf16 autocast over float32 weights, vanilla's
matmul is bf16 and the float32 bias promotes the sum to float32; F.linear would take a bf16 bias and
return bf16. Rotated, it must be vanilla's: the dtype and the values bit for bit, the weight
gradients within float32 rounding of DDP's sum, the input gradient (a sum over the output features the ring
splits) within bf16 rounding, at 2 and 3 ranks."""

import os

import pytest
import torch
from support.spawn import run_on_ranks
from support.zoo import zoo_config
from transformers import AutoModelForCausalLM

DENSE = "transformer.h.0.self_attention.dense"


def make_falcon_with_bias(path) -> str:
    config = zoo_config("falcon")
    config.bias = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # distinctive biases, not zeros
    model.save_pretrained(path)
    return str(path)


def _dense_under_autocast(ckpt):
    import hf_rtp
    from hf_rtp.distributed.tensors.sharding import chunk_rows

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ours = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, plan="auto").get_submodule(DENSE)
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).get_submodule(DENSE)
    assert type(theirs).__name__ == "FalconLinear" and theirs.bias is not None
    xs = [torch.randn(2, 5, theirs.in_features, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    x = xs[rank].clone().requires_grad_()
    refs = [x_r.clone().requires_grad_() for x_r in xs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x)
        expected = [theirs(x_r) for x_r in refs]
    out.float().square().sum().backward()
    sum(e.float().square().sum() for e in expected).backward()  # DDP's gradient: the mean over ranks' batches
    hf_rtp.sync_grads(ours)
    rows = slice(*chunk_rows(theirs.out_features, world, rank))
    return {
        "dtype": (out.dtype, expected[rank].dtype),
        "out": (out.detach() - expected[rank].detach()).abs().max().item(),
        # the input gradient sums over output features, which the ring splits: bf16 partial sums round apart
        "input grad": _relative(x.grad, refs[rank].grad),
        # DDP's mean: the ranks' float32 sums, added in another order than vanilla's accumulation here
        "weight grad": _relative(ours.weight.grad.to_local(), theirs.weight.grad[rows] / world),
        "bias grad": _relative(ours.bias.grad.to_local(), theirs.bias.grad[rows] / world),
        "grad dtypes": (ours.weight.grad.dtype, ours.bias.grad.dtype),
    }


def _relative(mine, theirs) -> float:
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("world", [2, 3])
def test_falcon_linear_with_a_bias_equals_vanilla_under_bf16_autocast(tmp_path, world):
    ckpt = make_falcon_with_bias(tmp_path / "falcon")
    for rank, seen in enumerate(run_on_ranks(_dense_under_autocast, world, ckpt)):
        assert seen["dtype"] == (torch.float32, torch.float32), rank  # promoted by the float32 bias, as vanilla
        assert seen["grad dtypes"] == (torch.float32, torch.float32), rank
        assert seen["out"] == 0.0, rank
        for what in ("weight grad", "bias grad"):
            assert seen[what] < 1e-6, (rank, what, seen[what])  # float32 rounding of a sum
        assert seen["input grad"] < 2**-7, (rank, seen["input grad"])  # within bf16's rounding of the largest
