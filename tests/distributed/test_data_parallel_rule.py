"""Rotated parameters are DTensors with data-parallel semantics: every SPMD path gives DDP's answer or refuses.

- full_tensor() under autograd: each rank's chunk gets the mean over all ranks' batches (DTensor's own
  backward would give it only its own batch's gradient), also after `model.to()` / `.double()`,
  which swap DTensor parameters for copies;
- redistribute() under autograd is refused; without autograd it works;
- pickling a state dict or an optimizer state that holds rotated tensors is refused (it would hold
  this rank's rows only); deepcopy still works (TRL copies reference models).
"""

import copy
import io
import os

import pytest
import torch
from support.models import make_tiny
from support.spawn import run_on_ranks


def _full_tensor_is_data_parallel(ckpt):
    from safetensors.torch import load_file
    from torch.distributed.tensor import Replicate

    import hf_rtp
    from hf_rtp.distributed.tensors.rotated import RotatedTensor
    from hf_rtp.distributed.tensors.sharding import chunk_rows

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    model.to("cpu").double()  # what Trainer and users do; must keep the data-parallel class
    head = model.lm_head.weight
    assert type(head) is RotatedTensor
    xs = torch.randn(world, 5, head.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (xs[rank] @ head.full_tensor().T).square().mean().backward()

    reference = load_file(os.path.join(ckpt, "model.safetensors"))["lm_head.weight"].double().requires_grad_()
    torch.stack([(x @ reference.T).square().mean() for x in xs]).mean().backward()  # DDP's objective
    start, end = chunk_rows(head.shape[0], world, rank)
    assert hf_rtp.local_rows(head) == (start, end)  # the public name for the rows this rank holds (I2)
    assert hf_rtp.local_rows(model.model.norm.weight) == (0, head.shape[1])  # a replicated one: all of it
    torch.testing.assert_close(head.grad.to_local(), reference.grad[start:end], atol=1e-12, rtol=1e-12)

    with pytest.raises(hf_rtp.RotatedStateError, match=r"redistribute.*full_tensor"):
        head.redistribute(placements=[Replicate()])
    with torch.no_grad():
        assert torch.equal(head.redistribute(placements=[Replicate()]).to_local(), reference.detach())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    for _what, state in (("model", model.state_dict()), ("optimizer", optimizer.state_dict())):
        with pytest.raises(hf_rtp.RotatedStateError, match=r"refusing to pickle a rotated tensor.*save_pretrained"):
            torch.save(state, io.BytesIO())
    model.zero_grad(set_to_none=True)  # torch cannot deepcopy a DTensor gradient, hf_rtp or not
    copied = copy.deepcopy(model.model.norm)  # replicated modules copy as before; so do rotated tensors
    assert torch.equal(copied.weight, model.model.norm.weight)
    assert torch.equal(copy.deepcopy(head).to_local(), head.to_local())


@pytest.mark.parametrize("world", [2, 3])
def test_full_tensor_gradient_is_the_ddp_mean_and_spmd_paths_are_refused(tmp_path, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    run_on_ranks(_full_tensor_is_data_parallel, world, ckpt)
