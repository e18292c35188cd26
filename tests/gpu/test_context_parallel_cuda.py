"""Context parallelism on CUDA: ring attention's flash, memory-efficient and cuDNN kernels against vanilla SDPA on
the whole sequence, on one GPU at two ranks (gpu_world.py: every rank on cuda:0, in the world .ci/gpu chose).

Each variant forces one kernel with `torch.nn.attention.sdpa_kernel` around the block (the ring picks among the
backends enabled, as SDPA does) and checks that the ring used it; vanilla runs SDPA's own pick on the same GPU
outside it. A tiny Llama with head size 64 and GQA (4 query heads, 2 K/V heads: flash takes them as they are,
the others get them repeated), 250 tokens: chunks of 62 and 63 at 2 ranks (uneven, and query runs the
memory-efficient kernel pads to a multiple of 32). Compared: the loss and every gradient (this rank's rows of
rotated ones). Each kernel's first use ran its probe (layers/attention.py) before the ring did.

The memory-efficient kernel runs fp16 blocks in float32 (layers/attention_kernels.py says why). What equality
holds: the ring rounds each block's output to the kernel's dtype and merges the blocks in float32,
where vanilla's kernel rounds once, and cuBLAS orders a rotated matmul's sums differently. Float32: 1e-4 of each
gradient's largest entry; fp16 (10 bits of mantissa): 1e-2; bf16 (8 bits) and bf16 autocast: 3e-2. A wrong
log-sum-exp layout, a lost block or a missing K/V head is off by the whole gradient.
"""

from __future__ import annotations

import pytest
import torch
from gpu_world import NO_CUDA, join_world
from support.compare import grad_gaps_rows
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.timeout(130),  # every variant runs in the first test's fixture: more than .ci/gpu's --timeout 60
]

SEQ = 250  # not a multiple of 2N = 4
# fp16 weights train under a loss scale (GradScaler's starts at 2**16). Unscaled, .ci/gpu saw k_proj's gradients
# 1.06e-2 and 1.84e-2 of their largest entry off (tolerance 1e-2) where the kernel's blocks were 6e-4 from exact
# attention: their entries (largest 7.8e-4 and 1.4e-3) sum terms near fp16's subnormals (under 6e-5), which the
# ring's per-block sums and vanilla's whole one round differently. That the scale closes the gap is the guess this
# tests; it has not run on a GPU yet. Gaps are relative: the scale cancels.
LOSS_SCALE = {"float16": 1024.0, "bfloat16": 1.0, "float32": 1.0}
VARIANTS = {  # name: (weights' dtype, bf16 autocast, the kernel forced, tolerance of the largest entry)
    "float32-efficient": ("float32", False, "efficient", 1e-4),
    "bf16-flash": ("bfloat16", False, "flash", 3e-2),
    "fp16-flash": ("float16", False, "flash", 1e-2),
    "bf16-autocast-flash": ("float32", True, "flash", 3e-2),
    "bf16-cudnn": ("bfloat16", False, "cudnn", 3e-2),
    "fp16-efficient": ("float16", False, "efficient", 1e-2),
}


def _batch(seq: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt: the ranks' label counts differ
    return {"input_ids": ids, "labels": labels}


def _variant_beside_vanilla(ckpt, dtype_name, autocast, forced):
    """One training step of hf_rtp under context parallelism with `forced` the only SDPA backend, and vanilla's on
    the whole sequence with SDPA's own pick: the losses, each gradient's (gap, scale), the kernels the ring used."""
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers import attention

    device = torch.device("cuda", 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    options: dict = dict(dtype=getattr(torch, dtype_name), attn_implementation="sdpa")
    model = hf_rtp.from_pretrained(ckpt, device=device, **options).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, **options).to(device).train()
    batch = {k: v.to(device) for k, v in _batch(SEQ).items()}
    given = {k: v.clone() for k, v in batch.items()}
    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[forced]
    # every variant probes its kernel afresh (the variants share this process: bf16 autocast and bf16 weights
    # would otherwise share flash's trust), and what it adds is the kernel it used
    attention._TRUSTED.clear()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        with sdpa_kernel(backend), hf_rtp.context_parallel(model, batch):
            loss = model(**batch).loss
            (loss * LOSS_SCALE[dtype_name]).backward()
        ref_loss = ref(**given).loss
        (ref_loss * LOSS_SCALE[dtype_name]).backward()
    hf_rtp.sync_grads(model)
    used = sorted({key[2] for key in attention._TRUSTED})
    gaps = grad_gaps_rows(model, ref, world, rank)
    return loss.item(), ref_loss.item(), gaps, used


def _every_variant(ckpt, names):
    """Each variant named, one after another in the same two ranks (one start of the ranks, their imports and
    NCCL's communicators for all six: 48 s on the H100, where six starts took 125 s); a variant that raises reports
    its error and the next runs. What one variant breaks for the process (a sticky CUDA error, ranks out of step
    after one raised alone) fails the variants after it too: read the first failure's traceback."""
    import traceback

    join_world()
    out = {}
    for name in names:
        dtype_name, autocast, forced, _ = VARIANTS[name]
        try:
            out[name] = _variant_beside_vanilla(ckpt, dtype_name, autocast, forced)
        except Exception:
            out[name] = traceback.format_exc()
        torch.cuda.empty_cache()
    return out


def _cudnn_attention_here() -> bool:
    return (
        torch.backends.cudnn.is_available()
        and (torch.backends.cudnn.version() or 0) >= 90000
        and torch.cuda.get_device_capability(0) >= (8, 0)
    )


def _skip_reason(variant: str) -> str | None:
    dtype_name, autocast, forced, _ = VARIANTS[variant]
    if forced == "cudnn" and not _cudnn_attention_here():
        return "cuDNN attention needs cuDNN 9 and compute capability 8.0"
    needs_ampere = dtype_name == "bfloat16" or autocast or forced in ("flash", "cudnn")
    if needs_ampere and torch.cuda.get_device_capability(0) < (8, 0):
        return "bf16, flash and cuDNN attention need compute capability 8.0"
    return None


@pytest.fixture(scope="module")
def variants_run(tmp_path_factory):
    """Every variant this GPU can run, in one start of two ranks: {variant: rank 0's and rank 1's results}."""
    ckpt = make_tiny("llama", tmp_path_factory.mktemp("cp") / "ckpt", hidden_size=256, intermediate_size=128)
    names = [name for name in VARIANTS if _skip_reason(name) is None]  # 4 heads of 64, 2 K/V heads
    results = run_on_ranks(_every_variant, 2, ckpt, names, fresh=True, timeout=120)  # inside the stage's 140 s
    return {name: [by_rank[name] for by_rank in results] for name in names}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_context_parallel_on_one_gpu_matches_vanilla_sdpa_with_each_kernel(variants_run, variant):
    reason = _skip_reason(variant)
    if reason:
        pytest.skip(reason)
    _, _, forced, tolerance = VARIANTS[variant]
    results = variants_run[variant]
    for rank, result in enumerate(results):
        assert not isinstance(result, str), f"rank {rank} raised:\n{result}"
    for rank, (loss, ref_loss, gaps, used) in enumerate(results):
        assert used == [forced], (rank, used)  # the ring ran the kernel forced, after its probe passed
        assert abs(loss - ref_loss) <= tolerance * abs(ref_loss), (rank, loss, ref_loss)
        over = {
            name: (gap, scale) for name, (gap, scale) in gaps.items() if not (scale > 0 and gap <= tolerance * scale)
        }
        assert not over, (rank, f"{len(over)} of {len(gaps)} gradients off", over)
    assert len({round(loss, 6) for loss, *_ in results}) == 1  # every rank reports the sequence's loss
