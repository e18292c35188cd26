"""Checkpoint offload on CUDA (model/offload.py): `activation_checkpointing_enable(offload=True)` keeps each
checkpointed layer's input in pinned host memory, copied on a side stream, beside plain checkpointing on the same
GPU in one process: every gradient equal (the same kernels on the same values), each layer's input held on the host
after the forward (its `_Held` entries), and less device memory held between forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_world import NO_CUDA
from support.models import VOCAB, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def test_offloaded_inputs_live_on_the_host_and_the_gradients_are_checkpointings():
    from transformers import AutoModelForCausalLM

    from hf_rtp.model import offload

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    ours = copy.deepcopy(plain)
    offload.install(ours, device)
    ours.activation_checkpointing_enable(offload=True)
    plain.activation_checkpointing_enable()
    ids = torch.randint(0, VOCAB, (1, 2048), device=device)  # a layer's input: 2 MB, above offload.SMALL_BYTES
    held = {}
    for name, model in (("plain", plain), ("ours", ours)):
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        loss = model.train()(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize(device)
        held[name] = torch.cuda.memory_allocated(device) - start  # what the graph keeps until backward
        if name == "ours":
            hooks = next(
                m._gradient_checkpointing_func.args[0] for m in model.modules() if hasattr(m, "gradient_checkpointing")
            )
            assert sum(r() is not None for r in hooks._packed) == 4  # every layer's input, on the host
        loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    assert held["ours"] <= held["plain"] - 4 * 2048 * 256 * 4, held  # four layers' inputs left the device
