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
        # a tiny model's chunks are quicker to send than a message's latency: "auto" walks them (_choice below)
        assert counts["auto"] == 0, counts


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
    # Hidden 512: an attention projection's chunk is 512 KB per hop at 2 ranks, the MLP's 1 MB. The weights make
    # one hop, the tokens two (out and back), each also a message's latency (HOP_BYTES in
    # distributed/transport/weights_or_tokens.py, 256 KB). One token per rank moves tokens; 128 (on the rank that
    # brings the most, on every rank) move weights. The embedding and the head (101 rows of 512) are small enough to
    # walk in any case.
    for name, seq in (("prefill", 128), ("decode", 1)):
        ids = global_batch(world, batch=1, seq=seq if rank == 0 else 1, seed=3)[rank]
        walks, sent = ring.token_walks, ring.sent_bytes
        with torch.no_grad():
            model(ids)
        found[name] = (ring.token_walks - walks, ring.sent_bytes - sent)
    layers = model.config.num_hidden_layers
    assert found["prefill"][0] == 0, found
    # per layer: q, k and v in one walk (layers.siblings, learnt from the prefill's calls), o, gate-up, down
    assert found["decode"][0] == 4 * layers, found
    assert rotated == 2 + 7 * layers
    assert found["decode"][1] * 10 < found["prefill"][1], found
    return found


def test_each_op_moves_whichever_costs_less_by_the_most_tokens_any_rank_brings(tmp_path):
    wide = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8)
    ckpt = make_tiny("llama", tmp_path / "ckpt", max_position_embeddings=256, **wide)
    run_on_ranks(_choice, 2, ckpt)


def _under_inference_mode(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_moves="activations")
    prompts = global_batch(world, batch=1 + rank, seq=4 + rank, seed=5)[rank]
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():  # tensors with no version counter: the tokens' identity cannot be read
        logits = model(prompts).logits
        tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
        expected = vanilla.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
        torch.testing.assert_close(logits, vanilla(prompts).logits, atol=1e-10, rtol=1e-10)
    assert torch.equal(tokens, expected), (tokens.tolist(), expected.tolist())
    walks = hf_rtp.state_of(model).topology.ring.token_walks
    # one rank under inference_mode, the other under no_grad: their ops would walk differently, so both refuse
    try:
        with torch.inference_mode() if rank == 0 else torch.no_grad():
            model(prompts)
        mixed = None
    except hf_rtp.CollectiveMisuseError as err:
        mixed = str(err)
    return walks, mixed


def test_a_forward_and_generate_under_inference_mode_move_tokens_as_under_no_grad(tmp_path):
    """torch.inference_mode (transformers' pipelines, many eval loops) makes tensors without a version counter,
    which the reuse of moved tokens read (k_proj after q_proj): such tokens move for each op instead. Ranks in
    different modes would walk differently: every rank refuses that forward by name."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for walks, mixed in run_on_ranks(_under_inference_mode, 2, ckpt):
        assert walks > 0
        assert mixed is not None and "under torch.inference_mode on rank(s) 0 only" in mixed, mixed


def _prompt_lookup(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_moves="activations")
    # rank 0's prompt repeats an n-gram, so prompt lookup proposes candidates there and none on rank 1: their
    # verification forwards keep different numbers of logits per sequence (logits_to_keep = candidates + 1)
    prompts = torch.tensor([[5, 6, 7, 8, 9, 5, 6]]) if rank == 0 else torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, prompt_lookup_num_tokens=3)
    settings.update(attention_mask=torch.ones_like(prompts))
    tokens = model.generate(prompts, **settings)
    assert torch.equal(tokens, vanilla.generate(prompts, **settings)), tokens.tolist()
    return hf_rtp.state_of(model).topology.ring.token_walks


def test_prompt_lookup_whose_ranks_keep_different_logits_equals_vanilla_when_tokens_move(tmp_path):
    """The LM head's walk starts at the most tokens any rank's head sees (logits_to_keep), not the most
    sequences: a rank that kept more logits than its sequences met a rank that read no count, and both failed."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert all(walks > 0 for walks in run_on_ranks(_prompt_lookup, 2, ckpt))
