"""The host-staged collectives outside the ring (distributed/transport/backends.py, `staged`; rotated.py's `_gathered`
and `_redistributed`; the context-parallel unshard and the embedding resize's scatter) on the CPU: a world of gloo on
CUDA takes that path (gloo's all_gather of CUDA tensors killed both ranks of the GPU check with SIGSEGV), and CI has
no GPU, so these ranks force the rotation mesh's host twin, over a gloo group of its own, and compare with vanilla
transformers (tests/support/gathers.py) at 2 and 3 ranks, uneven chunks included; that every gather of
full_tensor() and redistribute ran on the twin's group is read from the functional collectives' group names. The
staged branches of context_parallel_unshard and the embedding resize's scatter follow the ring's transport, never
"staged" on a CPU: tests/gpu/test_gathers_cuda.py runs them on a GPU. Without the twin, the same checks on the
device path."""

from __future__ import annotations

import pytest
import torch
from support.gathers import gathers_beside_vanilla
from support.models import make_tiny
from support.spawn import run_on_ranks


def _on_cpu(ckpt, out, force_host):
    return gathers_beside_vanilla(ckpt, out, torch.device("cpu"), force_host=force_host)


@pytest.mark.parametrize("world,force_host", [(2, True), (3, True), (2, False)])
def test_gathers_through_host_memory_are_vanillas(tmp_path, world, force_host):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, (checks, (gap, scale, where)) in enumerate(run_on_ranks(_on_cpu, world, ckpt, tmp_path, force_host)):
        assert checks.pop("staged") == force_host, rank
        assert all(checks.values()), (rank, checks)
        assert where == "cpu" and gap <= 1e-5 * scale, (rank, gap, scale)
