"""Tiled MLP (from_pretrained's tiled_mlp, model/tiled_mlp.py) on the ring, beside vanilla transformers on the same
weights in float64: a training step's every gradient and AdamW's step, each rank's 18 tokens in tiles of 4 or 5
(each tile a walk of the MLP's rotated weights, gate and up stacked), with gradient checkpointing around the layers
(the tiles then run inside the layer's recomputation; transformers' offload switch on, which hf_rtp ignores on the
CPU), at 3 ranks, with Qwen2's biases and LoRA on the MLP.
Context parallelism with tiles: tests/distributed/test_context_parallel.py's "tiled" variant."""

from __future__ import annotations

import os

import pytest
import torch
from support.compare import DTYPE, STEP_ATOL, adamw, assert_matches, backward_both, trainable_grad_gaps
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

CASES = {
    "llama-2": ("llama", 2, 4, False, False),
    "llama-3-checkpointing": ("llama", 3, 5, True, False),
    "qwen2-2-lora": ("qwen2", 2, 4, False, True),
}


def _tiled_beside_vanilla(ckpt, tile, checkpointing, lora):
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.model.state import state_of

    rank = int(os.environ["RANK"])
    plan = "auto" if "qwen2" in ckpt else None
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, plan=plan, tiled_mlp=tile)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    tiled = sum("forward" in vars(m) for n, m in model.named_modules() if n.endswith(".mlp"))
    if checkpointing:  # hf_rtp's with transformers' offload switch, which it ignores on the CPU (model/offload.py)
        model.activation_checkpointing_enable(offload=True)
        ref.gradient_checkpointing_enable()
    if lora:
        from peft import LoraConfig, get_peft_model

        def adapted(m):
            torch.manual_seed(0)  # the same adapters on both, B not zero
            config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
            return get_peft_model(m, config)

        model, ref = adapted(model), adapted(ref)
    model.train(), ref.train()
    ring = state_of(model).topology.ring
    calls: list[int] = []  # each down_proj's calls in the forward: one per tile
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for n, m in model.named_modules()
        if n.endswith("mlp.down_proj")
    ]
    before = ring.exchanges
    out = model(input_ids=global_batch(ring.size, seq=9)[rank])
    del out
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * -(-18 // tile), calls  # 18 tokens per rank: 5 or 4 tiles per layer
    backward_both(model, ref, global_batch(ring.size, seq=9), rank)  # 2 x 9 tokens per rank
    exchanges = ring.exchanges - before
    if lora:
        gaps = trainable_grad_gaps(model, ref)
        assert len(gaps) == 12 and all(gap <= 1e-12 + 1e-9 * scale for gap, scale in gaps.values()), gaps
        return tiled, exchanges
    assert_matches(model, ref, ring.size, rank, "grad")
    for optimizer in adamw(model, ref):
        optimizer.step()
    assert_matches(model, ref, ring.size, rank, "param", atol=STEP_ATOL)
    return tiled, exchanges


@pytest.mark.parametrize("case", list(CASES))
def test_a_tiled_mlp_trains_as_vanillas_whole_one(tmp_path, case):
    arch, world, tile, checkpointing, lora = CASES[case]
    ckpt = make_tiny(arch, tmp_path / f"{arch}-ckpt")
    results = run_on_ranks(_tiled_beside_vanilla, world, ckpt, tile, checkpointing, lora)
    for tiled, _ in results:
        assert tiled == 2, tiled  # both layers' MLPs
    # every rank walked the same hops (ranks that tiled differently would have met in other walks and failed)
    assert len({exchanges for _, exchanges in results}) == 1


def _forwards_between(ckpt, reentrant):
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.model.state import state_of

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, tiled_mlp=4)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    for m in (model, ref):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    ring = state_of(model).topology.ring
    long, short = global_batch(ring.size, seq=9), global_batch(ring.size, seq=1, seed=2)  # 18 and 2 tokens a rank
    with torch.no_grad():
        model(input_ids=short[rank])  # an evaluation between them too
    losses = [model(input_ids=b[rank], labels=b[rank]).loss for b in (long, short)]
    with torch.no_grad():
        model(input_ids=short[rank])
    sum(losses).backward()  # the long forward's layers recompute after two other forwards met
    hf_rtp.sync_grads(model)
    ref_loss = sum(ref(input_ids=b[r], labels=b[r]).loss for b in (long, short) for r in range(ring.size))
    (ref_loss / ring.size).backward()
    assert_matches(model, ref, ring.size, rank, "grad")
    return True


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_recomputes_with_its_own_forwards_tiles_after_other_forwards(tmp_path, reentrant):
    """Two forwards of other lengths before one backward, and evaluations between them, under layer checkpointing:
    each layer recomputes with the tiles its forward cut (tiled_mlp.pinned); non-reentrant checkpoint failed on it."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_forwards_between, 2, ckpt, reentrant) == [True, True]
