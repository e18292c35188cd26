"""`model.resize_token_embeddings` (model/vocabulary.py) in one process: at world size 1 a model hf_rtp loaded is
resized exactly as vanilla's (the same draws under the same seed, tied and untied, both mean_resizing modes,
pad_to_multiple_of, shrinking), and the size every rank computes for itself on a ring is vanilla's, refusals
included. The resize on rings of 2 and 3, and on a 2-D grid, is tests/distributed/test_resize_embeddings.py's."""

from __future__ import annotations

import pytest
import torch
from support.models import VOCAB, make_tiny, tiny_config
from transformers import AutoModelForCausalLM

import hf_rtp
from hf_rtp.model.vocabulary import _new_size

CASES = [  # (new_num_tokens, pad_to_multiple_of, mean_resizing)
    (VOCAB + 6, None, True),
    (VOCAB + 3, 8, False),
    (None, 16, True),  # only rounded up
    (VOCAB - 4, None, True),  # shrinking keeps the first rows
    (VOCAB, None, False),  # the same size: nothing drawn
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocabulary")
    return {tied: make_tiny("llama", folder / f"tied-{tied}", tied=tied) for tied in (False, True)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_resize_at_world_size_1_is_vanillas(checkpoints, tied):
    for case, (new, pad, mean_resizing) in enumerate(CASES):
        vanilla = AutoModelForCausalLM.from_pretrained(checkpoints[tied], dtype=torch.float64)
        model = hf_rtp.from_pretrained(checkpoints[tied], dtype=torch.float64)
        resized = {}
        for name, m in (("vanilla", vanilla), ("hf_rtp", model)):
            torch.manual_seed(case)
            resized[name] = m.resize_token_embeddings(new, pad_to_multiple_of=pad, mean_resizing=mean_resizing)
        assert resized["hf_rtp"] is model.get_input_embeddings()
        size = vanilla.config.vocab_size
        assert model.config.vocab_size == size == resized["hf_rtp"].num_embeddings == resized["vanilla"].num_embeddings
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        for name, param in vanilla.named_parameters():
            assert torch.equal(model.get_parameter(name), param), (case, name)
        ids = torch.tensor([[1, size - 1, 5, size - 2]])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, vanilla(ids).logits, rtol=0, atol=0)


def test_the_size_each_rank_computes_is_vanillas():
    torch.manual_seed(0)
    for new, pad, _ in [*CASES, (None, None, True), (VOCAB + 1, 1, True), (7, 4, True)]:
        vanilla = AutoModelForCausalLM.from_config(tiny_config("llama"))
        expected = vanilla.resize_token_embeddings(new, pad_to_multiple_of=pad).num_embeddings
        size = _new_size(VOCAB, new, pad)
        assert (VOCAB if size is None else size) == expected, (new, pad)
    for bad in (8.0, "8"):
        with pytest.raises(ValueError) as theirs:
            vanilla.resize_token_embeddings(VOCAB + 1, pad_to_multiple_of=bad)
        with pytest.raises(hf_rtp.SettingError) as ours:
            _new_size(VOCAB, VOCAB + 1, bad)
        assert isinstance(ours.value, ValueError) and str(ours.value) == str(theirs.value)
