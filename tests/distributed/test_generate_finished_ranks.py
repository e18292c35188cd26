"""generate() when ranks finish at different steps: one max_length on every rank with prompts of different lengths,
so one rank's budget runs out while another still decodes. A finished rank keeps walking the ring with the others
(synced_gpus) without stepping its own decode past its limit: a static cache sized by its max_length, an assisted
decode's draft budget. Each rank's tokens equal vanilla generate's on its own prompts, and the rank that finished
first has the random state vanilla's rank would have. What generate cannot do on a ring is refused by name."""

import os

import torch
from support.models import make_tiny
from support.spawn import run_on_ranks

from hf_rtp.errors import CollectiveMisuseError


def _uneven_budgets(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    assistant = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, num_hidden_layers=1)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    # rank 0: 5 prompt tokens, rank 1: 8; with max_length 12 rank 1 is done 3 steps before rank 0
    prompts = torch.randint(3, 101, (1, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    common = dict(max_length=12, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(prompts))
    cases = {
        "static cache": dict(do_sample=False, cache_implementation="static"),
        "a vanilla assistant": dict(do_sample=False, assistant_model=assistant),
        "sampling": dict(do_sample=True, top_k=0, temperature=0.8),
        "beam search": dict(do_sample=False, num_beams=2, num_return_sequences=2),
    }
    states = {}
    for name, settings in cases.items():
        torch.manual_seed(100 + rank)
        expected = vanilla.generate(prompts, **common, **settings)
        after_vanilla = torch.get_rng_state()
        torch.manual_seed(100 + rank)
        tokens = model.generate(prompts, **common, **settings)
        assert torch.equal(tokens, expected), (name, rank, tokens.tolist(), expected.tolist())
        states[name] = torch.equal(torch.get_rng_state(), after_vanilla)
    refused = {}
    refusals = {
        "synced_gpus=False": dict(synced_gpus=False),
        "rotated": dict(assistant_model=model),
        "drafting itself": dict(assistant_early_exit=1),
        "prefill chunks": dict(prefill_chunk_size=5),  # 1 chunk of rank 0's 5 tokens, 2 of rank 1's 8
    }
    for name, settings in refusals.items():
        try:
            model.generate(prompts, do_sample=False, **common, **settings)
            refused[name] = None
        except CollectiveMisuseError as err:
            refused[name] = str(err)
    try:  # the prompt by generate's own keyword
        model.generate(inputs=prompts, do_sample=False, prefill_chunk_size=5, **common)
        refused["prefill chunks, inputs="] = None
    except CollectiveMisuseError as err:
        refused["prefill chunks, inputs="] = str(err)
    return states, refused


def test_a_rank_whose_budget_ends_first_walks_on_without_stepping_its_own_decode(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for states, refused in run_on_ranks(_uneven_budgets, 2, ckpt):
        assert all(states.values()), states  # the random state after generate: vanilla's, on both ranks
        assert "synced_gpus" in (refused["synced_gpus=False"] or ""), refused
        assert "assistant loaded by hf_rtp" in (refused["rotated"] or ""), refused
        assert "generate(assistant_early_exit=...), where the model drafts for itself" in refused["drafting itself"]
        for key in ("prefill chunks", "prefill chunks, inputs="):
            chunks = refused[key] or ""
            assert "prefill chunks (prefill_chunk_size" in chunks and "rank 1: 2" in chunks, (key, chunks)


def _ring_of_one(ckpt):
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    prompts = torch.tensor([[5, 6, 7]])
    tokens = model.generate(prompts, max_new_tokens=2, do_sample=False, synced_gpus=False, pad_token_id=0)
    return "_has_unfinished_sequences" in model.__dict__, tuple(tokens.shape)


def test_one_rank_decodes_as_transformers_does(tmp_path):
    """With one process nothing walks: synced_gpus=False is transformers' own, and no check is swapped in."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_ring_of_one, 1, ckpt) == [(False, (1, 5))]


def _chunks_after_a_cache(ckpt):
    """A chunked prefill from a passed cache chunks only the tokens it does not hold (transformers' `_prefill`)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    import hf_rtp

    rank = int(os.environ["RANK"])
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    out = {}
    # (prompt length, tokens cached) per rank; chunks of 5 over the uncached tokens: 1 and 1 (the whole prompts would
    # be 2 and 1: refused before), then 1 and 2 (the whole prompts 2 and 2: ranks fell out of step before)
    for name, shapes in (("same chunks", ((10, 6), (5, 1))), ("other chunks", ((10, 6), (7, 1)))):
        length, held = shapes[rank]
        prompts = torch.randint(3, 101, (1, length), generator=torch.Generator().manual_seed(rank))
        caches = []
        for m in (model, vanilla):
            cache = DynamicCache(config=m.config)
            with torch.no_grad():
                m(input_ids=prompts[:, :held], past_key_values=cache, use_cache=True)
            caches.append(cache)
        settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None, prefill_chunk_size=5)
        try:
            tokens = model.generate(prompts, past_key_values=caches[0], **settings)
        except CollectiveMisuseError as err:
            out[name] = str(err)
            continue
        expected = vanilla.generate(prompts, past_key_values=caches[1], **settings)
        out[name] = torch.equal(tokens, expected)
    return out


def test_a_chunked_prefill_from_a_cache_counts_the_chunks_it_makes(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for out in run_on_ranks(_chunks_after_a_cache, 2, ckpt):
        assert out["same chunks"] is True, out
        said = out["other chunks"]
        assert isinstance(said, str) and "rank 0: 1" in said and "rank 1: 2" in said, out


def _out_of_step(ckpt):
    """One rank makes a forward of its own inside generate (from a stopping criterion) while the other asks
    whether every rank is done."""
    import time

    from transformers import StoppingCriteria, StoppingCriteriaList

    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)

    class Peeks(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if rank == 1:
                model(input_ids=input_ids[:, -1:], use_cache=False)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    prompts = torch.tensor([[5, 6, 7]])
    began = time.monotonic()
    try:
        model.generate(
            prompts,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Peeks()]),
        )
    except CollectiveMisuseError as err:
        return str(err), time.monotonic() - began
    return None, time.monotonic() - began


def test_ranks_out_of_step_inside_generate_fail_at_once_each_call_named(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for said, seconds in run_on_ranks(_out_of_step, 2, ckpt):
        assert said is not None and "rank 0: generate's step" in said and "rank 1: forward" in said, said
        assert seconds < 30  # not the 60 s entry timeout, nor the default group's
