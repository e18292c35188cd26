"""A rotated model changes nothing process-wide: DTensor's mixing check stays on for every other DTensor.

A rotated model holds DTensor and plain parameters, and `clip_grad_norm_` or a foreach optimizer over
all of them mixes the two kinds. hf_rtp allows that mixing only inside ops on its own rotated tensors
(distributed/tensors/rotated.py), so a TP or FSDP model beside it in the same process (a reference model, a reward
model) still gets torch's error when it mixes. Compared with vanilla under DDP in float64.
"""

import os

import pytest
import torch
from support.compare import ADAM_EPS, ATOL, DTYPE, LR, RTOL, STEP_ATOL, assert_matches, backward_both
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

MIXING = "got mixed torch.Tensor and DTensor"


def _mixing_refused(mesh) -> bool:
    """Does torch refuse a plain DTensor op that mixes in a plain (non-scalar) tensor?"""
    from torch.distributed.tensor import Replicate, distribute_tensor

    plain = distribute_tensor(torch.ones(4, 3, dtype=DTYPE), mesh, [Replicate()])
    try:
        plain + torch.ones(4, 3, dtype=DTYPE)
    except RuntimeError as err:
        assert MIXING in str(err), err
        return True
    return False


def _train_beside_a_plain_dtensor(ckpt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.tensors.rotated import RotatedTensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    refused = [_mixing_refused(mesh)]
    model.train(), ref.train()
    batches = global_batch(world)
    backward_both(model, ref, batches, rank)
    rotated_grads = {type(p.grad).__name__ for p in model.parameters() if isinstance(p, DTensor)}
    refused.append(_mixing_refused(mesh))

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # mixes both kinds
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    torch.testing.assert_close(
        norm.full_tensor() if isinstance(norm, DTensor) else norm, ref_norm, atol=ATOL, rtol=RTOL
    )
    refused.append(_mixing_refused(mesh))
    torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, foreach=True).step()  # one foreach op over both kinds
    torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS).step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)
    refused.append(_mixing_refused(mesh))
    return refused, rotated_grads, DTensor._op_dispatcher._allow_implicit_replication, RotatedTensor.__name__


@pytest.mark.parametrize("world", [2])
def test_clip_and_foreach_adamw_mix_rotated_and_plain_while_other_dtensors_keep_torchs_check(tmp_path, world):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    for refused, rotated_grads, allowed, name in run_on_ranks(_train_beside_a_plain_dtensor, world, ckpt):
        assert refused == [True, True, True, True]  # after load, backward, clip and the optimizer step
        assert rotated_grads == {name}  # gradients of rotated parameters are rotated too
        assert allowed is False
