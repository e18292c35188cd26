"""Checkpoint offload (model/offload.py): transformers' `activation_checkpointing_enable(offload=True)` on a model
hf_rtp loaded. On the CPU it is ignored, by name, and training is checkpointing's without it (vanilla's own offload
fails there under a CPU-only torch, which has no pinned allocator; a CUDA build pins host memory even without a
GPU). The CUDA path: tests/gpu/test_offload_cuda.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from support.models import VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from hf_rtp.model import offload


def _pair():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float64)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("call", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_offload_on_the_cpu_is_ignored_by_name_and_trains_as_checkpointing(call, caplog):
    ours, plain = _pair()
    offload.install(ours, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        if call == "activation_checkpointing_enable":
            ours.activation_checkpointing_enable(offload=True)
        else:  # the deprecated alias PEFT's prepare_model_for_kbit_training calls, with Trainer's kwargs
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    assert "activation_checkpointing_enable(offload=True) is ignored on cpu" in caplog.text
    assert ours.is_gradient_checkpointing
    plain.activation_checkpointing_enable()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    for model in (ours, plain):
        model.train()(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name


def test_vanillas_own_offload_fails_on_this_cpu_which_is_why_it_is_ignored():
    model, _ = _pair()
    if torch.version.cuda is not None or torch.accelerator.is_available():
        # torch 2.14.1's CUDA build on this CPU machine pins host memory without a GPU: vanilla's offload runs there
        pytest.skip("a CUDA build of torch or an accelerator: vanilla's offload has a pinned allocator here")
    model.activation_checkpointing_enable(offload=True)
    ids = torch.randint(0, VOCAB, (2, 11))
    with pytest.raises(RuntimeError, match="pin_memory=True requires a CUDA"):
        model.train()(input_ids=ids, labels=ids).loss.backward()
