"""Decoding by moving tokens instead of weights (from_pretrained's rotation_moves): each rank applies its own
rows to every rank's tokens and the outputs go home. Greedy tokens and every step's logits equal vanilla
generate on each rank's own prompts, and so do sampled tokens under the same seeds, whichever way the ops
walk, for every layer kind: linear, embedding and the LM head (llama), Conv1D (gpt2), MoE experts
(mixtral), the 4-bit and 8-bit frozen layers; ranks bring different numbers of sequences and lengths."""

import json
import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

MOVES = ("weights", "activations", "auto")


def _quantization(quantized):
    from transformers import BitsAndBytesConfig

    if quantized == "4bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)}
    if quantized == "8bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=1.0)}
    return {}


def _decode(ckpt, quantized, sample):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(ckpt, "config.json")) as f:
        extra = {"experts_implementation": "eager"} if json.load(f)["model_type"] == "mixtral" else {}
    extra.update(_quantization(quantized))
    # float64 (float32 where bitsandbytes computes): greedy is an argmax, which a float32 near-tie could flip
    dtype = torch.float32 if quantized else torch.float64
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **extra)
    # each rank its own number of prompts and length: shorter token sets travel padded
    prompts = global_batch(world, batch=1 + rank, seq=4 + 2 * rank, seed=7)[rank]
    settings = dict(max_new_tokens=4, pad_token_id=0, eos_token_id=None, output_logits=True)
    settings.update(return_dict_in_generate=True, attention_mask=torch.ones_like(prompts))
    if sample:
        settings.update(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    else:
        settings.update(do_sample=False)

    def generated(model):
        torch.manual_seed(1234 + rank)  # the same seed for ours and vanilla's
        out = model.generate(prompts, **settings)
        return out.sequences, torch.stack(out.logits)

    if quantized == "4bit":
        # On the CPU, bitsandbytes' eval-mode Linear4bit repacks the weight (for good) for a kernel of its own, which
        # rounds float32 otherwise (up to 4e-3 here) than gemm_4bit, the op its training mode runs and hf_rtp runs
        # per piece: the logits are compared with vanilla's gemm_4bit (first), the tokens with its eval mode.
        _, expected_logits = generated(vanilla.train())  # no dropout in llama: the same function
        expected, _ = generated(vanilla.eval())
    else:
        expected, expected_logits = generated(vanilla)
    walked = {}
    for moves in MOVES:
        model = hf_rtp.from_pretrained(ckpt, dtype=dtype, rotation_moves=moves, **extra)
        ring = hf_rtp.state_of(model).topology.ring
        tokens, logits = generated(model)
        assert torch.equal(tokens, expected), f"{moves}, rank {rank}: {tokens.tolist()} != {expected.tolist()}"
        tolerance = dict(atol=1e-4, rtol=1e-4) if quantized else dict(atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(logits, expected_logits, **tolerance)
        assert ring.traffic is None  # cleared after generate: a later op outside a forward moves weights
        walked[moves] = ring.token_walks
        del model
    return walked


@pytest.mark.parametrize(
    "arch, quantized, world",
    [("llama", "", 3), ("gpt2", "", 2), ("mixtral", "", 2), ("llama", "4bit", 2), ("llama", "8bit", 2)],
)
def test_greedy_tokens_and_logits_equal_vanilla_whichever_way_the_ops_walk(tmp_path, arch, quantized, world):
    # bitsandbytes' blocks of 64 need rows of 64 at least (test_qlora's WIDE)
    wide = dict(hidden_size=64, intermediate_size=128, head_dim=16) if quantized else {}
    ckpt = make_tiny(arch, tmp_path / "ckpt", **wide)
    walked = run_on_ranks(_decode, world, ckpt, quantized, False)
    for counts in walked:
        assert counts["weights"] == 0 and counts["activations"] > 0, counts
        assert counts["auto"] > 0, counts  # a tiny model's decode: tokens are fewer bytes than any weight chunk


def test_sampling_with_the_same_seeds_equals_vanilla_when_tokens_move(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    walked = run_on_ranks(_decode, 2, ckpt, "", True)
    assert all(counts["activations"] > 0 for counts in walked)


def _choice(ckpt):
    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    ring = hf_rtp.state_of(model).topology.ring
    rotated = len(hf_rtp.state_of(model).resolution.rotated)
    found = {}
    # hidden 32 (models.py): a chunk of a 32 x 32 linear is 512 elements per hop at 2 ranks, one token's input
    # and output 64; 16 tokens (on the rank that brings the most) move the linears' weights
    for name, seq in (("prefill", 16), ("decode", 1)):
        ids = global_batch(world, batch=1, seq=seq if rank == 0 else 1, seed=3)[rank]
        walks, sent = ring.token_walks, ring.sent_bytes
        with torch.no_grad():
            model(ids)
        found[name] = (ring.token_walks - walks, ring.sent_bytes - sent)
    # The most tokens any rank brings decide, on every rank: the linears and the embedding move weights (16 tokens
    # would be fewer bytes than the embedding's 51 rows, but more than this tiny model's weight slots hold, which
    # is all a token walk may use). The LM head's walk starts at one sequence's tokens (generate keeps each
    # sequence's last logits); this forward asks for all 16, which every rank learns from that walk, and the head
    # then moves its weights.
    assert found["prefill"][0] == 1, found
    # Every rotated op moved tokens, q, k and v in one walk, gate and up in another (layers.siblings, learnt from
    # the calls of the forward before): the embedding, the head, and per layer qkv, o, gate-up and down
    assert found["decode"][0] == 2 + 4 * model.config.num_hidden_layers, found
    assert rotated == 2 + 7 * model.config.num_hidden_layers
    assert found["decode"][1] * 5 < found["prefill"][1], found
    return found


def test_each_op_moves_whichever_is_fewer_bytes_by_the_most_tokens_any_rank_brings(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    run_on_ranks(_choice, 2, ckpt)
