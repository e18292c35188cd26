"""One training step as users write it, in phases a host-sync recorder can name (tests/distributed/test_host_syncs.py
on the CPU, tests/gpu/test_host_syncs_cuda.py under CUDA's sync debug mode)."""

from __future__ import annotations

import torch


def user_step(model, batch, labels, optimizer, rotated: bool, recorder=None, foreach: bool | None = None) -> None:
    """Forward with labels, backward, sync_grads (hf_rtp's plain loop; DDP averages in backward), clip_grad_norm_,
    the optimizer's step; `recorder.phase` names each phase when a recorder is given."""
    import hf_rtp

    def phase(name):
        if recorder is not None:
            recorder.phase = name

    phase("forward")
    loss = model(input_ids=batch, labels=labels).loss
    phase("backward")
    loss.backward()
    if rotated:
        phase("sync_grads")
        hf_rtp.sync_grads(model)
    phase("clip_grad_norm_")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    phase("step")
    optimizer.step()
    optimizer.zero_grad()
