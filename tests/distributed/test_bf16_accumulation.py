"""Gradients under bf16 autocast and of LoRA on a bf16 base are vanilla DDP's, within vanilla's own noise floor.

A rotated linear's input gradient is a sum over the ring's chunks, `sum_c g[:, c] @ W_c`, where vanilla's one
matmul sums every row in float32 and rounds to bf16 once; the fused loss's hidden-state gradient is such a sum over
the head's pieces. Rounding each chunk's partial to bf16 before the sum moved every gradient below the LM head by
2e-3 to 8e-3 (relative L2) from vanilla's (the GPU check's users' loop, benchmarks/results/gpu-check-h200-run12.log),
where vanilla is 1e-7 to 1e-4 from itself. Here, in one run at 2 and 3 ranks over gloo on the CPU: hf_rtp, vanilla
transformers under DDP, and vanilla under DDP with each rank's batch in reversed order (the floor: every weight
gradient's sum over tokens in another order, nothing else changed), compared by tests/gpu/noise_floor.py's rule
(FACTOR x the floor, or LEAST), which also checks that vanilla's per-rank gradients summed in bf16 would fail it.
No tiled MLP here: a tile's weight gradient is rounded to bf16 on its own (model/tiled_mlp.py), which no ring
changes and this comparison would read as a fault (tests/e2e/test_users_paths.py keeps that apart).
"""

import importlib.util
import os

import pytest
import torch
from support.models import VOCAB, make_tiny_llama
from support.spawn import run_on_ranks

GPU_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")
BATCH, SEQ = 2, 16  # two sequences a rank: reversing them reorders every weight gradient's sum over tokens
VARIANTS = {  # name: (weights' dtype, bf16 autocast, LoRA)
    "autocast": (torch.float32, True, False),
    "lora-bf16": (torch.bfloat16, False, True),
}


def _module(name):
    """tests/gpu's noise_floor.py or users_loop.py, by path (tests/gpu is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(GPU_TESTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(ckpt, which, dtype, lora):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    if which == "rtp":
        model = hf_rtp.from_pretrained(ckpt, dtype=dtype, rotation_moves="weights")
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapters on every model (B zero: PEFT's default)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.train()


def _gaps(ckpt):
    """Per variant: hf_rtp's gradient gaps to vanilla, vanilla-reordered's (the floor), and bf16-summed vanilla's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    noise_floor, users_loop = _module("noise_floor"), _module("users_loop")
    grads_of = users_loop._trainable_grads  # rotated gradients as this rank's rows; vanilla's cut to them
    out = {}
    for name, (dtype, autocast, lora) in VARIANTS.items():
        models = {which: _load(ckpt, which.split("-")[0], dtype, lora) for which in ("rtp", "vanilla", "vanilla-b")}
        rank, world = dist.get_rank(), dist.get_world_size()
        batch = torch.randint(0, VOCAB, (world, BATCH, SEQ), generator=torch.Generator().manual_seed(5))[rank]
        wrapped = {which: DDP(m) for which, m in models.items()}

        def backward(which, model, batch=batch, autocast=autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()

        with wrapped["vanilla"].no_sync():  # this rank's gradient alone: what a bf16 accumulator would sum
            backward("vanilla", wrapped["vanilla"])
        mine = grads_of(models["vanilla"], world, rank)
        per_rank = [{} for _ in range(world)]
        for n, g in mine.items():
            everyone = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(everyone, g.contiguous())
            for r in range(world):
                per_rank[r][n] = everyone[r]
        models["vanilla"].zero_grad(set_to_none=True)
        for which, model in wrapped.items():
            backward(which, model, batch.flip(0) if which == "vanilla-b" else batch)
        vanilla = grads_of(models["vanilla"], world, rank)
        out[name] = {
            "mine": noise_floor.gaps(grads_of(models["rtp"], world, rank), grads_of(models["vanilla"], world, rank,
                                                                                   rows_of=models["rtp"])),
            "floor": noise_floor.gaps(grads_of(models["vanilla-b"], world, rank), vanilla),
            "bf16": noise_floor.gaps(noise_floor.bf16_accumulated(per_rank), vanilla),
        }  # fmt: skip
        wrapped.clear(), models.clear()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_gradients_are_vanillas_within_its_noise_floor(tmp_path, world):
    noise_floor = _module("noise_floor")
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    results = run_on_ranks(_gaps, world, ckpt)
    failures, lines = [], []
    for rank, variants in enumerate(results):
        for name, v in variants.items():
            limit = noise_floor.tolerance(v["floor"])
            lines.append(
                f"rank {rank}, {name}: largest gap {max(v['mine'].values()):.3g}, floor {max(v['floor'].values()):.3g}"
                f", tolerance {limit:.3g}, bf16-summed {max(v['bf16'].values()):.3g}"
            )
            failures += [
                f"rank {rank}, {name}: {f}" for f in noise_floor.judge_gradients(v["mine"], v["floor"], v["bf16"])
            ]
            assert len(v["mine"]) > 0
    print("\n".join(lines))
    assert not failures, "\n".join(lines + failures)
