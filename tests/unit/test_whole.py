"""`hf_rtp.whole_model` (model/whole.py) of a model loaded in one process, where no weight is rotated: a vanilla
model of the same class and state (buffers that are not saved included: Gemma's embedding scale, the rotary
tables), that shares no memory with the model it copies, in eval mode, in the dtype asked; and refused for a
model hf_rtp did not load. The gathered copy of a model rotated over 2 ranks is tests/distributed/test_generate.py's."""

from __future__ import annotations

import pytest
import torch
from support.zoo import zoo_config
from transformers import AutoModelForCausalLM

import hf_rtp


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma: a tied head and a non-persistent buffer (embed_scale) beside the rotary tables."""
    folder = tmp_path_factory.mktemp("whole") / "gemma"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(zoo_config("gemma"), dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def _vanilla_buffers(whole, vanilla) -> None:
    theirs = dict(vanilla.named_buffers())
    assert {n for n, _ in whole.named_buffers()} == theirs.keys() and "model.embed_tokens.embed_scale" in theirs
    for name, buffer in whole.named_buffers():
        assert buffer.dtype == theirs[name].dtype and torch.equal(buffer, theirs[name]), name


def test_a_single_process_models_whole_copy_is_vanilla_and_its_own(gemma):
    model = hf_rtp.from_pretrained(gemma, dtype=torch.float32).train()
    vanilla = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    whole = hf_rtp.whole_model(model)
    assert type(whole) is type(vanilla) and not whole.training and not hf_rtp.is_rotated(whole)
    _vanilla_buffers(whole, vanilla)
    assert whole.state_dict().keys() == vanilla.state_dict().keys()
    for name, tensor in vanilla.state_dict().items():
        assert torch.equal(whole.state_dict()[name], tensor), name
    assert whole.lm_head.weight is whole.model.embed_tokens.weight  # tied as vanilla ties it
    assert whole.generation_config.to_dict() == model.generation_config.to_dict()
    assert whole.generation_config is not model.generation_config
    ids = torch.tensor([[1, 7, 3, 9, 4]])
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, vanilla.eval()(ids).logits, rtol=0, atol=0)
    assert torch.equal(whole.generate(ids, **settings), vanilla.generate(ids, **settings))
    # nothing shared: in one process the model's weights are plain tensors, which a copy must not alias
    mine = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    assert not mine & ({p.data_ptr() for p in whole.parameters()} | {b.data_ptr() for b in whole.buffers()})
    with torch.no_grad():
        whole.model.norm.weight.add_(1)
    assert torch.equal(model.model.norm.weight, vanilla.model.norm.weight)
    half = hf_rtp.whole_model(model, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.model.embed_tokens.weight, vanilla.model.embed_tokens.weight.bfloat16())


def test_the_copys_buffers_keep_the_models_dtype_as_vanillas_do(gemma):
    """A float64 Gemma's embed_scale stays float64 in the copy (it was once made in torch's default dtype and the
    model's value copied in, rounded to float32: the copy's logits then differed from vanilla's by 2e-8)."""
    model = hf_rtp.from_pretrained(gemma, dtype=torch.float64)
    vanilla = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float64)
    whole = hf_rtp.whole_model(model)
    ids = torch.tensor([[1, 7, 3, 9, 4]])
    with torch.no_grad():
        torch.testing.assert_close(whole(ids).logits, vanilla(ids).logits, rtol=0, atol=0)
    _vanilla_buffers(whole, vanilla)


def test_a_model_hf_rtp_did_not_load_is_refused(gemma):
    vanilla = AutoModelForCausalLM.from_pretrained(gemma)
    with pytest.raises(hf_rtp.HfRtpError, match=r"GemmaForCausalLM holds no model loaded with hf_rtp\.from_pretrained"):
        hf_rtp.whole_model(vanilla)
