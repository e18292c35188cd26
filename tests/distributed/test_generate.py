"""generate() on a rotated model: each rank generates for its own prompts, ranks keep stepping
together until all are done, and each rank's greedy tokens equal vanilla generate on its prompts."""

import json
import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _generate_like_vanilla(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(ckpt, "config.json")) as f:
        extra = {"experts_implementation": "eager"} if json.load(f)["model_type"] == "mixtral" else {}
    # float64: greedy decoding is an argmax, and a float32 near-tie could flip on summation order alone
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, **extra)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, **extra)
    everyone = [global_batch(world, batch=2, seq=5 + r, seed=7)[r] for r in range(world)]
    prompts = everyone[rank]  # each rank its own prompts and length
    # The same settings on every rank, but rank 0's sequences end early: the second token vanilla greedily
    # generates for each of its rows is an end of sequence. Done first, rank 0 must keep stepping with the others.
    settings = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    first = ref.generate(everyone[0], attention_mask=torch.ones_like(everyone[0]), eos_token_id=None, **settings)
    settings["eos_token_id"] = first[:, 5 + 1].tolist()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
    expected = ref.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
    assert torch.equal(out, expected), f"rank {rank}: {out.tolist()} != {expected.tolist()}"
    return out.shape[1] - (5 + rank)


# 3 ranks for mixtral only (rotated experts and uneven lengths); the zoo generates with llama and gpt2 at 3
@pytest.mark.parametrize(
    "arch, world_size", [(a, n) for a in ("llama", "gpt2", "mixtral") for n in (1, 2)] + [("mixtral", 3)]
)
def test_generate_matches_vanilla(tmp_path, arch, world_size):
    ckpt = make_tiny(arch, tmp_path / "ckpt")
    generated = run_on_ranks(_generate_like_vanilla, world_size, ckpt)
    assert generated[0] <= 2  # rank 0 stopped early
    assert world_size == 1 or max(generated) > 2, generated  # while another went on


def _whole_copies(checkpoints):
    return [_whole_copy(ckpt, tied) for tied, ckpt in checkpoints.items()]


def _whole_copy(ckpt, tied):
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    whole = hf_rtp.whole_model(model)
    assert type(whole) is type(ref) and not whole.training
    assert not any(isinstance(p, DTensor) for p in whole.parameters())  # whole, plain, no ring
    ref_state = ref.state_dict()
    assert all(torch.equal(t, ref_state[n]) for n, t in whole.state_dict().items())
    assert (whole.lm_head.weight is whole.model.embed_tokens.weight) == tied
    prompts = global_batch(world, batch=2, seq=5, seed=3)[rank]
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(whole.generate(prompts, **settings), ref.generate(prompts, **settings))
    # its own weights: a step on the copy leaves the rotated model as it was
    with torch.no_grad():
        whole.model.norm.weight.add_(1)
    assert torch.equal(model.model.norm.weight, ref.model.norm.weight)
    half = hf_rtp.whole_model(model, dtype=torch.float32)
    return {p.dtype for p in half.parameters()}


def test_whole_model_is_vanilla_with_the_gathered_weights(tmp_path):
    checkpoints = {tied: make_tiny("llama", tmp_path / str(tied), tied=tied) for tied in (False, True)}
    assert run_on_ranks(_whole_copies, 2, checkpoints) == [[{torch.float32}] * 2] * 2
