"""hf_rtp's collectives outside the ring on CUDA, at two ranks on cuda:0, beside vanilla transformers on the same
GPU (tests/support/gathers.py): `full_tensor()` of a rotated parameter (without autograd, and under it, where its
gradient is the mean over the ranks' batches), `redistribute` to Replicate, `context_parallel_unshard` of the
logits, `save_pretrained`'s files and `resize_token_embeddings` (a scatter of the new rows).

In a world where gloo serves CUDA tensors ("cpu:gloo,cuda:gloo", the GPU check's world without NCCL 2.30) gloo
runs all_reduce and broadcast only: its all_gather of CUDA tensors, which DTensor's full_tensor() issues, killed
both ranks with SIGSEGV on an H100 (docs/testing.md), so hf_rtp gathers and scatters host copies there
(distributed/transport/backends.py, `staged`). Over NCCL the same calls run on the device.

What equality holds: gathered and saved weights are vanilla's bytes (`torch.equal`); the full_tensor gradient is
the mean of each rank's (rank + 1) exactly; logits are float32 matmuls on a chunk's rows against vanilla's on the
whole weight (cuBLAS orders sums by shape, TF32 off): 1e-4 of the largest entry.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_world import GLOO_WORLD, NO_CUDA, join_world
from support.gathers import gathers_beside_vanilla
from support.models import make_tiny
from support.spawn import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def _on_cuda(ckpt, out):
    return gathers_beside_vanilla(ckpt, out, join_world())


def test_gathers_scatters_and_saves_on_cuda_are_vanillas(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    staged = os.environ.get("HF_RTP_TEST_BACKEND", GLOO_WORLD) == GLOO_WORLD
    for rank, (checks, (gap, scale, where)) in enumerate(run_on_ranks(_on_cuda, 2, ckpt, tmp_path, fresh=True)):
        assert checks.pop("staged") == staged, (rank, staged)
        assert all(checks.values()), (rank, checks)
        assert where == "cuda:0" and gap <= 1e-4 * scale, (rank, gap, scale, where)
