"""The fused LM-head loss on a ring of one, against transformers' own loss in the same process.

The head is a RotatedLinear on a ring of one (no process group), so the fused path's math runs
exactly as on N ranks minus the transfers; logits are cut into small tiles so the running
log-sum-exp crosses tile boundaries. Head weights are scaled up so that soft-capping and logit
scaling change the loss visibly. Multi-rank pieces are covered by tests/distributed/test_fused_loss.py
and the zoo.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from support.compare import GRAD_RTOL
from support.models import VOCAB
from support.zoo import zoo_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.layers import RotatedLinear, fused_loss
from hf_rtp.model.forward import install_forward
from hf_rtp.model.fused_head import read_head

FLOAT32_NOISE = 2e-6


def _rotate_head(model):
    head = model.get_output_embeddings()
    model.set_output_embeddings(RotatedLinear(head, ring=Ring(None), weight=head.weight, bias=head.bias))


def _pair(name, dtype=torch.float64, **overrides):
    config = zoo_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(40)  # logits of several units: caps and scales matter
    model = copy.deepcopy(ref)
    _rotate_head(model)
    assert install_forward(model, fused=True)
    return model.train(), ref.train()


def _batch(seed=3):
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt the loss ignores
    return ids, labels


def _assert_same_grads(model, ref, noise=FLOAT32_NOISE):
    """Equal up to float32 rounding (the loss math is float32 in both, summed in another order): with
    logits of several units that is ~1e-6 of a gradient's scale (vanilla's own distance to a float64
    loss is the same size), where a wrong term is off by the whole scale."""
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        expected = theirs[name].grad
        torch.testing.assert_close(
            p.grad,
            expected,
            atol=noise * expected.abs().max().item(),
            rtol=GRAD_RTOL,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # tiles of 17 rows x 17 tokens: the running log-sum-exp crosses row and token boundaries
    monkeypatch.setattr(fused_loss, "BLOCK_BYTES", 4 * VOCAB * 3)
    monkeypatch.setattr(fused_loss, "ROW_ALIGN", 1)


@pytest.mark.parametrize(
    "tokens, rows, elements",
    [(18, 101, 303), (1024, 7812, 4 * 2**20), (3072, 128256, 2**26), (5, 3, 9), (1, 128256, 2**22), (0, 10, 4)],
)
def test_tiles_cover_every_logit_once_in_aligned_widths(tokens, rows, elements, monkeypatch):
    monkeypatch.setattr(fused_loss, "ROW_ALIGN", 64)
    seen = torch.zeros(rows, tokens, dtype=torch.int32)
    tiles = fused_loss._tiles(tokens, rows, elements)
    for r0, r1, b0, b1 in tiles:
        seen[r0:r1, b0:b1] += 1
        assert (r1 - r0) * (b1 - b0) <= max(elements, r1 - r0)  # one token of a piece wider than a tile
        assert r1 == rows or (r1 - r0) % fused_loss.ROW_ALIGN == 0
    assert (seen == 1).all()


# llama: plain; gemma2: soft-capping (and a tied head); cohere: * logit_scale; granite: / logits_scaling;
# phi: a biased head; mixtral: the aux loss added after ours; gpt2: tied, another backbone
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama", {}),
        ("gemma2", dict(final_logit_softcapping=2.0)),
        ("cohere", dict(logit_scale=3.0)),
        ("granite", dict(logits_scaling=0.25)),
        ("phi", {}),
        ("mixtral", {}),
        ("gpt2", {}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_loss_and_every_gradient_match_vanilla(name, overrides):
    model, ref = _pair(name, **overrides)
    ids, labels = _batch()
    out, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits is None  # never built
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-6, rtol=1e-6)
    assert out.loss.dtype == expected.loss.dtype == torch.float32  # transformers' float32 loss math
    if name == "mixtral":
        torch.testing.assert_close(out.aux_loss, expected.aux_loss)
    out.loss.backward(), expected.loss.backward()
    _assert_same_grads(model, ref)


def test_softcap_and_scale_are_really_applied():
    """The comparison above would pass with the transform dropped if it changed nothing: it does."""
    model, _ = _pair("gemma2", final_logit_softcapping=2.0)
    ids, labels = _batch()
    with torch.no_grad():
        capped = model(input_ids=ids, labels=labels).loss
        model.config.final_logit_softcapping = None
        uncapped = model(input_ids=ids, labels=labels).loss
    assert abs(capped - uncapped) > 0.1


def test_num_items_in_batch_and_shift_labels_as_vanilla():
    model, ref = _pair("llama")
    ids, labels = _batch()
    n = torch.tensor(23)  # Trainer's count over all accumulated micro-batches
    out, expected = (
        model(input_ids=ids, labels=labels, num_items_in_batch=n),
        ref(input_ids=ids, labels=labels, num_items_in_batch=n),
    )
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-6, rtol=1e-6)
    out.loss.backward(), expected.loss.backward()
    _assert_same_grads(model, ref)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, shift_labels=shifted)
        expected = ref(input_ids=ids, labels=labels, shift_labels=shifted)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-6, rtol=1e-6)


def test_all_ignored_is_nan_like_vanilla():
    model, ref = _pair("llama")
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    with torch.no_grad():
        assert torch.isnan(model(input_ids=ids, labels=labels).loss) and torch.isnan(
            ref(input_ids=ids, labels=labels).loss
        )


def test_logits_wherever_users_read_them():
    model, ref = _pair("llama")
    ids, labels = _batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=labels)
        asked = model(input_ids=ids, labels=labels, return_logits=True)  # the opt-out, in training
        no_labels = model(input_ids=ids)
        model.eval(), ref.eval()
        evaluated = model(input_ids=ids, labels=labels)  # Trainer's evaluation with compute_metrics
    for out in (asked, no_labels, evaluated):
        torch.testing.assert_close(out.logits, expected.logits, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(asked.loss, expected.loss)
    assert no_labels.loss is None
    generated = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, ref.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0))


def test_bf16_autocast_matches_vanilla_within_bf16_rounding():
    model, ref = _pair("llama", dtype=torch.float32)
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, expected.loss, atol=2e-2, rtol=2e-2)
    out.loss.backward(), expected.loss.backward()
    head, ref_head = model.get_output_embeddings().weight.grad, ref.get_output_embeddings().weight.grad
    assert head.dtype == torch.float32  # the parameter's dtype, as vanilla's cast-back gives
    torch.testing.assert_close(head, ref_head, atol=2e-2 * ref_head.abs().max().item(), rtol=0)


def test_labels_outside_the_vocabulary_fail():
    model, _ = _pair("llama")
    ids, labels = _batch()
    labels[1, 5] = VOCAB
    with pytest.raises(RuntimeError, match="labels must be -100 or lie in"):
        model(input_ids=ids, labels=labels)


class _ShiftedLlama(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits + 1.0
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return loss, logits


def test_heads_it_cannot_reproduce_keep_the_plain_loss(caplog):
    config = zoo_config("llama")
    model = _ShiftedLlama(config)
    _rotate_head(model)
    _, reason = read_head(model)
    assert "`logits = logits + 1.0`" in reason
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        assert not install_forward(model, fused=True)
    assert "fused LM-head loss is off" in caplog.text and "logits + 1.0" in caplog.text
    ids, labels = _batch()
    _loss, logits = model.train()(input_ids=ids, labels=labels)
    assert logits.shape == (2, 9, VOCAB)  # the plain path, with its logits

    custom = AutoModelForCausalLM.from_config(config)
    _rotate_head(custom)
    custom.loss_function = lambda logits, labels, **kw: logits.mean()
    assert "ForCausalLMLoss" in read_head(custom)[1]
    plain = AutoModelForCausalLM.from_config(config)  # a head that is not rotated (a ring of one)
    assert "not a rotated linear" in read_head(plain)[1]


def test_a_loss_function_set_after_loading_gets_the_logits():
    """A user's own loss (label smoothing, say) set on the model later must see real logits, not the
    fused path's empty stand-in."""
    model, ref = _pair("llama")
    ids, labels = _batch()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().logsumexp(-1).mean()
    ref.loss_function = model.loss_function
    with torch.no_grad():
        out, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, expected.loss)
