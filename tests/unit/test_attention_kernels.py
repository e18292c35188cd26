"""Ring attention's kernels (hf_rtp/layers/attention_kernels.py) and the probe that trusts one (layers/attention.py).

The choice is a pure function of device type, dtype, head size, the enabled SDPA backends and the compute
capability, checked here for CUDA too; calling the CUDA kernels needs a GPU (tests/gpu/test_context_parallel_cuda.py).
On the CPU the probe runs the CPU flash kernel blockwise as a ring does and passes; a fault that spoils its merged
result is refused by name, on every rank of a ring at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.models import VOCAB, make_tiny_llama
from support.spawn import run_on_ranks
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_rtp import faults
from hf_rtp.distributed.tensors.sequence import SequenceLayout
from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.errors import SettingError
from hf_rtp.layers import attention
from hf_rtp.layers.attention import probe, ring_attention, trusted
from hf_rtp.layers.attention_kernels import (
    BACKENDS,
    CPU_FLASH,
    CUDNN,
    EFFICIENT,
    FLASH,
    choose,
    enabled_backends,
    kernel_for,
    normalised_lse,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
HOPPER, AMPERE, ADA, TURING = (9, 0), (8, 0), (8, 9), (7, 5)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "dtype,head,enabled,capability,want",
    [
        (BF16, 64, BACKENDS, HOPPER, FLASH),
        (FP16, 128, BACKENDS, AMPERE, FLASH),
        (FP32, 64, BACKENDS, HOPPER, EFFICIENT),  # flash and cuDNN take half precision only
        (BF16, 64, ("efficient", "cudnn"), HOPPER, EFFICIENT),  # a user's sdpa_kernel without flash
        (BF16, 64, ("cudnn",), HOPPER, CUDNN),
        (BF16, 36, BACKENDS, HOPPER, FLASH),  # called with heads padded to 40
        (BF16, 320, BACKENDS, HOPPER, EFFICIENT),  # wider than flash's 256
        (BF16, 256, BACKENDS, ADA, EFFICIENT),  # SDPA's rule: no flash backward over 192 on 8.6 and 8.9
        (FP16, 64, BACKENDS, TURING, EFFICIENT),  # flash needs 8.0
        (BF16, 64, BACKENDS, None, FLASH),  # capability not known: not checked
    ],
)
def test_cuda_kernels_are_chosen_as_sdpa_chooses(dtype, head, enabled, capability, want):
    assert choose("cuda", dtype, head, enabled, capability) is want


@pytest.mark.parametrize(
    "dtype,head,enabled,capability,named",
    [
        (FP64, 64, BACKENDS, HOPPER, "flash: no float64; efficient: no float64; cudnn: no float64"),
        (FP32, 64, ("flash", "cudnn"), HOPPER, "efficient: disabled"),
        (BF16, 192, ("cudnn",), HOPPER, "cudnn: heads of at most 128"),
        (BF16, 64, BACKENDS, TURING, "no bfloat16 before compute capability 8.0"),
    ],
)
def test_no_kernel_that_fits_is_refused_naming_dtype_heads_and_each_reason(dtype, head, enabled, capability, named):
    with pytest.raises(SettingError, match="no attention kernel that returns its log-sum-exp") as refused:
        choose("cuda", dtype, head, enabled, capability)
    assert named in str(refused.value) and f"{dtype} heads of {head} on cuda" in str(refused.value)


def test_the_cpu_kernel_takes_every_float_dtype_and_answers_to_the_flash_switch():
    assert all(choose("cpu", dtype, 8) is CPU_FLASH for dtype in (BF16, FP16, FP32, FP64))
    with pytest.raises(SettingError, match="cpu flash: disabled"):
        choose("cpu", FP32, 8, ("efficient", "cudnn"))
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(SettingError, match="cpu flash: disabled"):
        kernel_for(CPU, FP32, 8)  # the switches read now, as a user's sdpa_kernel sets them
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert "flash" not in enabled_backends() and "efficient" in enabled_backends()
    assert kernel_for(CPU, FP32, 8) is CPU_FLASH
    with pytest.raises(SettingError, match="kernels for cpu and cuda tensors, not mps"):
        choose("mps", FP32, 8)


@pytest.mark.parametrize("kernel", [FLASH, EFFICIENT, CUDNN], ids=lambda k: k.name)
def test_the_cuda_kernels_are_called_by_their_schemas_argument_names(kernel):
    """Their calls reach the dispatcher with every argument named as torch 2.13's schema names it (None for the
    cumulative lengths a dense forward leaves undefined): on CPU tensors it then finds no CPU kernel."""
    q, seed = torch.randn(1, 2, 8, 8, dtype=BF16), torch.empty((), dtype=torch.long)
    aux = (seed, seed) if kernel is EFFICIENT else (None, None, seed, seed)
    with pytest.raises(NotImplementedError, match="with arguments from the 'CPU' backend"):
        kernel.forward(q, q, q, True, 0.3)
    with pytest.raises(NotImplementedError, match="with arguments from the 'CPU' backend"):
        kernel.backward(q, q, q, q, q, torch.zeros(1, 2, 8), aux, True, 0.3)


def test_cuda_heads_are_padded_to_a_multiple_of_8_and_cpu_heads_are_not():
    assert [FLASH.width(h) for h in (8, 36, 64, 100)] == [8, 40, 64, 104]
    assert CPU_FLASH.width(36) == 36


def test_every_kernels_log_sum_exp_is_normalised_to_batch_heads_queries_in_the_merge_dtype():
    lse = torch.randn(2, 3, 5)
    padded = torch.cat([lse, torch.full((2, 3, 27), float("nan"))], -1)  # the efficient kernel: queries to 32n
    assert torch.equal(normalised_lse(padded, 5, BF16), lse)
    assert torch.equal(normalised_lse(lse.unsqueeze(-1), 5, FP16), lse)  # cuDNN: a trailing dim of 1
    assert normalised_lse(lse, 5, BF16).dtype == FP32  # float32 for half inputs
    assert normalised_lse(lse.double(), 5, FP64).dtype == FP64  # float64 kept for float64 inputs


@pytest.mark.parametrize(
    "dtype,head,value_head,grouped,kernel",
    [
        (FP64, 8, 8, True, CPU_FLASH),  # GQA taken by the kernel (torch 2.13's CPU flash)
        (FP32, 8, 8, True, dataclasses.replace(CPU_FLASH, grouped=False)),  # GQA repeated, as for efficient and cuDNN
        (BF16, 12, 8, False, dataclasses.replace(CPU_FLASH, multiple=8)),  # heads padded to 16, values widened
        (FP16, 16, 16, True, CPU_FLASH),
    ],
    ids=["float64-gqa", "float32-gqa-repeated", "bf16-padded-mla", "fp16-gqa"],
)
def test_the_probe_passes_the_cpu_kernel_blockwise_as_the_ring_merges_it(dtype, head, value_head, grouped, kernel):
    probe(kernel, CPU, dtype, head, value_head, grouped)


def test_a_kernel_is_trusted_once_per_process_and_key():
    attention._TRUSTED.clear()
    assert trusted(CPU, FP64, 8, 8, 2) is CPU_FLASH
    assert (str(CPU), FP64, "cpu flash", 8, 8, True) in attention._TRUSTED


@pytest.mark.parametrize("action", ["corrupt"])
def test_a_spoilt_merge_is_refused_naming_the_kernel_dtype_and_gap(monkeypatch, action):
    faults.point("attention.probe")  # reached unset: the setting below counts from zero, whatever ran before
    monkeypatch.setenv("HF_RTP_FAULT", f"{action}@attention.probe")
    with pytest.raises(SettingError, match=r"cpu flash kernel on cpu in float32 \(heads of 8\) does not compute"):
        probe(CPU_FLASH, CPU, FP32, 8, 8, True)
    probe(CPU_FLASH, CPU, FP32, 8, 8, True)  # the first time only: the fault fired once
    with pytest.raises(SettingError, match=r"'save\.write' computes no result to corrupt"):
        faults.parse(f"{action}@save.write")


def test_under_autocast_the_ring_runs_in_autocasts_dtype_as_sdpa_does():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=BF16):
        got = ring_attention(q, k, v, None, Ring(None), SequenceLayout(9, 1))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    got.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == FP32  # the cast's gradient comes back in the input's dtype


def _refused_on_every_rank(ckpt):
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with pytest.raises(SettingError) as refused, hf_rtp.context_parallel(model, batch):
        model(**batch)
    return str(refused.value)


def test_a_kernel_one_rank_refuses_is_refused_on_every_rank_before_the_ring_walks(tmp_path):
    """Rank 1's probe is spoilt (HF_RTP_FAULT): the refusal goes through the agreement at the forward's start,
    so rank 0, whose probe passed, raises too instead of waiting in the ring."""
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    messages = run_on_ranks(_refused_on_every_rank, 2, ckpt, env={"HF_RTP_FAULT": "corrupt@attention.probe#1"})
    assert all("cpu flash kernel on cpu in float64 (heads of 8) does not compute" in m for m in messages), messages
    assert messages[0].startswith("rank 1 failed: ")
