"""Linears on the same input walk the ring as one (layers/stacked.py, layers/siblings.py's STACKED): q, k and v as
one walk and gate and up as another, so a Llama layer's seven linears walk as four.

Each case runs two forwards and backwards beside vanilla transformers on the same weights (float64, DDP's semantics:
support/compare.py), comparing every gradient after each, then AdamW's step on the second's gradients. In the first
every linear walks alone (its group taken away); the second walks stacked. Beside them, the ring's exchanges per
step: the second's are fewer by the hops the stacked walks save. Grouped-query attention makes q's rows twice k's
and v's, so a stacked chunk holds members of three sizes; 3 ranks cut them unevenly; 1 KB pieces cut a stacked chunk
across its members; Qwen2's q/k/v carry biases; gradient checkpointing recomputes the stacked forward inside
backward; LoRA adapters wrap the members (PEFT), whose frozen weights then walk for the input's gradient only.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.compare import ATOL, DTYPE, RTOL, STEP_ATOL, adamw, assert_matches, backward_both, trainable_grad_gaps
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

CASES = {
    "llama-2": ("llama", 2, "16MB", False),
    "llama-3": ("llama", 3, "16MB", False),
    "llama-pieces-3": ("llama", 3, "1KB", False),
    "qwen2-biases-2": ("qwen2", 2, "16MB", False),
    "llama-checkpointing-2": ("llama", 2, "16MB", True),
}


def _stacked_groups(model) -> int:
    """How many sibling groups walk two or more members stacked (layers/siblings.py's STACKED)."""
    from hf_rtp.layers import RotatedLinear

    groups = {id(m.siblings): m.siblings for m in model.modules() if type(m) is RotatedLinear and "siblings" in vars(m)}
    return sum(bool(g.stacked) for g in groups.values())


def _two_steps(ckpt, piece_size, checkpointing):
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.model.state import state_of

    rank = int(os.environ["RANK"])
    plan = "auto" if "qwen2" in ckpt else None
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, plan=plan, rotation_piece_size=piece_size)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    if checkpointing:
        for m in (model, ref):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(), ref.train()
    ring = state_of(model).topology.ring
    exchanges = []
    groups = {m: vars(m).pop("siblings") for m in model.modules() if "siblings" in vars(m)}  # each walks alone
    for step in range(2):  # no optimizer step between: the second forward sees vanilla's weights exactly
        model.zero_grad(), ref.zero_grad()
        before = ring.exchanges
        backward_both(model, ref, global_batch(ring.size, seed=step + 1), rank)
        exchanges.append(ring.exchanges - before)
        assert_matches(model, ref, ring.size, rank, "grad")
        for m, group in groups.items():  # then stacked
            m.siblings = group
    for optimizer in adamw(model, ref):
        optimizer.step()
    assert_matches(model, ref, ring.size, rank, "param", atol=STEP_ATOL)
    return exchanges, _stacked_groups(model)


@pytest.mark.parametrize("case", list(CASES))
def test_the_second_step_walks_stacked_and_trains_as_vanilla(tmp_path, case):
    arch, world, piece_size, checkpointing = CASES[case]
    ckpt = make_tiny(arch, tmp_path / f"{arch}-ckpt")
    for exchanges, groups in run_on_ranks(_two_steps, world, ckpt, piece_size, checkpointing):
        assert groups == 4, groups  # q/k/v and gate/up in each of the 2 layers
        first, second = exchanges
        # in 1 KB pieces a stacked chunk walks in as many pieces as its members did: fewer walks, not fewer hops
        assert second < first if piece_size == "16MB" else second <= first, exchanges
        if piece_size == "16MB" and not checkpointing:
            # per layer, 7 linears' walks become 4: forward (N-1 hops each), backward's weights and gradients
            # (N-1 each): 3 walks x 3 (N-1) exchanges saved per layer, 2 layers
            assert first - second == 2 * 3 * 3 * (world - 1), exchanges


def _lora_two_steps(ckpt):
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)

    def adapted(m):
        torch.manual_seed(0)  # the same adapters on both
        targets = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
        return get_peft_model(m, config).train()

    model, vanilla = adapted(model), adapted(vanilla)
    ddp = DistributedDataParallel(vanilla)
    gaps = []
    for step in range(2):
        batch = global_batch(2, seed=step + 1)[rank]
        for m in (model, ddp):
            m(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        gaps.append(trainable_grad_gaps(model, vanilla))
        model.zero_grad(), vanilla.zero_grad()
    return gaps, _stacked_groups(model)


def test_lora_on_stacked_members_gives_vanillas_adapter_gradients(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for gaps, groups in run_on_ranks(_lora_two_steps, 2, ckpt):
        assert groups == 4, groups
        for step in gaps:
            assert sum("lora_A" in n for n in step) == 10, sorted(step)
            for name, (difference, largest) in step.items():
                assert largest > 0 and difference <= ATOL + RTOL * largest, (name, difference, largest)
