"""Where a training forward moves the tokens instead of the weights (few tokens:
distributed/transport/weights_or_tokens.py), the embedding's and the fused LM head's backward move the tokens too: the
embedding's tokens visit every rank with their output gradients, each rank adding up its own chunk's gradient
(Ring.visit_walk, N-1 hops); the head's travel with their log-sum-exps and loss gradients, and their hidden states'
gradient comes home (N hops). No piece of either, and no accumulator of either, walks the ring in backward.

Each case loads with rotation_moves="activations" (at these tiny shapes "auto" would walk the weights) and a
vocabulary large enough that a step's tokens fit the weights' slots. Ranks bring sequences of different lengths
(the shorter travel padded) with a label ignored mid-sequence. Loss, every gradient and one AdamW step are
compared with vanilla on the global batch (DDP's mean), in float64; beside them, the kinds of hop the ring made,
and that no weights' slot grew beyond the plan to hold a token message. Llama with a padding row (vanilla never
updates it), tied at 3 ranks (uneven chunks, both uses of one weight), Phi's biased head (its bias raised by 90: a
padding row's logits would overflow exp), Gemma 2's logit softcap and scaled embedding; and in 20 KB pieces, where
the head's tokens would not fit a slot, its weights walk, forward and backward, beside the embedding's tokens.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, STEP_ATOL, adamw, assert_matches, trainable_grad_gaps
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks
from support.zoo import zoo_config

from hf_rtp.distributed.transport.pool import HEADROOM

VOCAB = 1009  # prime, as the suite's: uneven chunks; large enough that the tokens fit the weights' slots
PAD = 5
WEIGHTS_TAG = 0  # distributed/transport/ring.py's hops of weight pieces

CASES = {  # name: (family, ranks, rotation_piece_size, head's backward moves tokens)
    "llama-2": ("llama", 2, "16MB", True),
    "llama-tied-3": ("llama-tied", 3, "16MB", True),
    "phi-biased-head-2": ("phi", 2, "16MB", True),
    "gemma2-softcap-3": ("gemma2", 3, "16MB", True),
    "llama-20KB-pieces-2": ("llama", 2, "20KB", False),
}


def _checkpoint(family: str, path) -> str:
    from transformers import AutoModelForCausalLM

    if family.startswith("llama"):
        return make_tiny("llama", path, tied=family == "llama-tied", vocab_size=VOCAB, pad_token_id=PAD)
    config = zoo_config(family)
    config.vocab_size, config.pad_token_id = VOCAB, PAD
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if family == "phi":  # the softmax does not move; exp(logit) of a padding row overflows float32
            model.lm_head.bias.add_(90.0)
    model.save_pretrained(path)
    return str(path)


def _step(ckpt, piece_size, plan):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.model.state import state_of

    torch.manual_seed(0)
    model = hf_rtp.from_pretrained(
        ckpt, dtype=torch.float64, rotation_moves="activations", rotation_piece_size=piece_size, plan=plan
    ).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).train()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [b[:, : 9 - r] for r, b in enumerate(global_batch(world, batch=2, seq=9))]  # rank 0 brings the most
    labels = []
    for b in batches:
        b[0, :2] = PAD
        labels.append(b.clone())
        labels[-1][1, 3] = -100
    assert model.get_input_embeddings().padding_idx == PAD

    tags: list[int] = []
    exchange = Ring.exchange

    def recorded(self, send, recv, tag):  # the real hop, its kind noted
        tags.append(tag)
        return exchange(self, send, recv, tag)

    Ring.exchange = recorded
    try:
        out = model(input_ids=batches[rank], labels=labels[rank])
        forward = Counter(tags)
        tags.clear()
        out.loss.backward()
        backward = Counter(tags)
    finally:
        Ring.exchange = exchange
    ref_losses = [ref(input_ids=b, labels=lab).loss for b, lab in zip(batches, labels, strict=True)]
    torch.testing.assert_close(out.loss, ref_losses[rank], atol=1e-8, rtol=1e-6)
    hf_rtp.sync_grads(model)
    torch.stack(ref_losses).mean().backward()
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert model.get_input_embeddings().weight.grad is not None
    for optimizer in adamw(model, ref):
        optimizer.step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)
    pool = state_of(model).topology.ring.pool
    slots = [b.numel() for b in pool.buffers("weights")]
    return forward, backward, slots, pool.planned(torch.device("cpu")) * 8


@pytest.mark.parametrize("case", list(CASES))
def test_embedding_and_head_backward_move_the_tokens_the_forward_moved(tmp_path, case):
    from hf_rtp.distributed.transport.token_walk import TOKEN_GRAD_TAG, TOKEN_TAG

    family, world, piece_size, head_moves = CASES[case]
    ckpt = _checkpoint(family, tmp_path / "ckpt")
    plan = "auto" if family == "phi" else None  # Phi has no registered plan
    for forward, backward, slots, planned in run_on_ranks(_step, world, ckpt, piece_size, plan):
        # every op moved tokens in forward (rotation_moves="activations"), or the head walked its weights
        assert forward[TOKEN_TAG] > 0 and (forward[WEIGHTS_TAG] == 0) == head_moves, forward
        assert backward[TOKEN_GRAD_TAG] == world - 1, backward  # the embedding's tokens visited every rank once
        # the head's tokens walked out (N-1 hops) and their gradient home (1), or the head's weights walked
        assert backward[TOKEN_TAG] == (world if head_moves else 0), backward
        # float64: 8 bytes per planned element, and a watched hop's header after them
        assert slots and max(slots) <= planned + HEADROOM, (slots, planned)


def _lora_step(ckpt):
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.transport.ring import Ring

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_moves="activations")
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)

    def adapted(m):
        torch.manual_seed(0)  # the same adapters on both
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj"])
        return get_peft_model(m, config).train()

    model, vanilla = adapted(model), adapted(vanilla)
    ddp = DistributedDataParallel(vanilla)
    tags: list[int] = []
    exchange = Ring.exchange

    def recorded(self, send, recv, tag):
        tags.append(tag)
        return exchange(self, send, recv, tag)

    batch = global_batch(2, seed=3)[rank]
    Ring.exchange = recorded
    try:
        loss = model(input_ids=batch, labels=batch).loss
        tags.clear()
        loss.backward()
    finally:
        Ring.exchange = exchange
    ddp(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)
    return trainable_grad_gaps(model, vanilla), Counter(tags)


def test_a_frozen_head_and_embedding_move_tokens_for_the_adapters_gradients(tmp_path):
    """LoRA (PEFT) on q_proj: the head and the embedding are frozen. The head's backward still moves the tokens,
    for the hidden states' gradient only; the frozen embedding's backward does not walk at all. The adapters'
    gradients are vanilla PEFT's under DDP."""
    from hf_rtp.distributed.transport.token_walk import TOKEN_GRAD_TAG, TOKEN_TAG

    ckpt = make_tiny("llama", tmp_path / "ckpt", vocab_size=VOCAB)
    for gaps, backward in run_on_ranks(_lora_step, 2, ckpt):
        assert sum("lora_A" in name for name in gaps) == 2, sorted(gaps)
        for name, (difference, largest) in gaps.items():
            assert largest > 0 and difference <= 1e-8 + 1e-6 * largest, (name, difference, largest)
        assert backward[TOKEN_GRAD_TAG] == 0, backward  # a frozen embedding's gradient is not made
        assert backward[TOKEN_TAG] == 2, backward  # the head's tokens out and their hidden gradient home


def _autocast_grads(ckpt):
    import hf_rtp
    from hf_rtp.model.state import state_of

    rank = int(os.environ["RANK"])
    batch = global_batch(2, seed=5)[rank]
    found = {}
    for moves in ("activations", "weights"):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, rotation_moves=moves).train()
        ring = state_of(model).topology.ring
        walks = ring.token_walks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in model.named_parameters()}
        slots = [b.numel() for b in ring.pool.buffers("weights")]
        found[moves] = (loss.item(), grads, ring.token_walks - walks, slots, ring.pool.planned(torch.device("cpu")))
    (loss_t, grads_t, walks_t, slots_t, planned), (loss_w, grads_w, walks_w, _, _) = (
        found["activations"],
        found["weights"],
    )
    assert walks_t > 0 and walks_w == 0, (walks_t, walks_w)
    assert max(slots_t) <= planned * 2 + HEADROOM, (slots_t, planned)  # bf16 travel: 2 bytes per planned element
    assert abs(loss_t - loss_w) <= 1e-2 * abs(loss_w), (loss_t, loss_w)
    for name, g in grads_t.items():  # bf16 matmuls summed in another order: bf16-sized differences only
        torch.testing.assert_close(g, grads_w[name], atol=2e-3, rtol=5e-2, msg=lambda m, name=name: f"{name}: {m}")


def test_under_bf16_autocast_moving_tokens_trains_as_walking_weights(tmp_path):
    """One setting away: float32 weights under bf16 autocast, where the hidden states travel in bf16 and the slots
    hold bf16 pieces. Loss and every gradient match the same step with the weights walking, to bf16's precision,
    and no weight slot grows past its bf16 plan."""
    ckpt = make_tiny("llama", tmp_path / "ckpt", vocab_size=VOCAB)
    run_on_ranks(_autocast_grads, 2, ckpt)
