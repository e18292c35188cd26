"""World size 1 is plain PyTorch (DESIGN.md I8): a plain loop steps without sync_grads, nothing is checked.

At world size > 1 a step over replicated gradients nothing averaged is refused
(tests/distributed/test_unsynced_steps.py); in one process there is nothing to average over.
"""

from __future__ import annotations

import torch
from support.models import global_batch, make_tiny_llama

import hf_rtp
from hf_rtp.model import step_check


def test_a_world_of_one_steps_without_sync_grads(tmp_path):
    model = hf_rtp.from_pretrained(make_tiny_llama(tmp_path / "ckpt"), dtype=torch.float32).train()
    assert hf_rtp.state_of(model).topology.world_size == 1
    assert not any(p in step_check._OWNERS for p in model.parameters())  # no gradient is watched
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norm = model.model.norm.weight.detach().clone()
    batch = global_batch(1)[0]
    for _ in range(2):
        model(input_ids=batch, labels=batch).loss.backward()  # no sync_grads
        optimizer.step()
        assert not step_check._PENDING
        optimizer.zero_grad()
    assert not torch.equal(model.model.norm.weight, norm)  # the replicated norm stepped
    hf_rtp.sync_grads(model)  # a no-op here: no process group
