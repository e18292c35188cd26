"""hf_rtp's `fused_lm_head=True` forward for TRL on a ring of one, against TRL's own fused head on the
vanilla model in the same process: the loss, every per-token output SFTTrainer reads (log-probs,
entropy, top-1, label mask), and every gradient, including one through the entropy; and what DPO and
GRPO ask for besides (log sum p^2, the mean logit, a temperature, the head in float32), where the
temperature's place among the family's transforms matters. Float64, logits of several units so that
soft-capping and scaling matter. Multi-rank: tests/distributed/test_trl.py, test_trl_fused_options.py.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_loss_ring_of_one import (
    FLOAT32_NOISE,
    _assert_same_grads,
    _batch,
    _pair,
    small_blocks,  # noqa: F401 (small tiles here too)
)

pytest.importorskip("trl")

OUTPUTS = ("log_probs", "entropy", "is_top1")


def _trl_pair(name, outputs=OUTPUTS, temperature=1.0, cast_lm_head_to_fp32=False, **overrides):
    from trl.trainer.utils import add_fused_lm_head

    from hf_rtp.integrations import trl

    model, ref = _pair(name, **overrides)
    trl.install(model, outputs, temperature, cast_lm_head_to_fp32)
    add_fused_lm_head(ref, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    return model, ref


def _run(model, ids, labels, entropy_weight, extra=lambda out: 0.0, **kwargs):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True, **kwargs)
    # an entropy term in the loss, as entropy-regularised trainers have: its gradient must be right too
    (out.loss + entropy_weight * out.entropy.sum() + extra(out)).backward()
    return out


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama", {}),
        ("gemma2", dict(final_logit_softcapping=2.0)),
        ("cohere", dict(logit_scale=3.0)),
        ("phi", {}),
        ("mixtral", dict(output_router_logits=True)),
        ("gpt2", {}),
    ],
)
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_outputs_and_every_gradient_match_trl(name, overrides, entropy_weight):
    model, ref = _trl_pair(name, **overrides)
    ids, labels = _batch()
    ours, theirs = _run(model, ids, labels, entropy_weight), _run(ref, ids, labels, entropy_weight)
    for field in ("loss", "log_probs", "aux_loss"):
        if getattr(theirs, field) is not None:
            torch.testing.assert_close(
                getattr(ours, field), getattr(theirs, field), msg=lambda m, field=field: f"{field}: {m}"
            )
    # entropy = lse - sum p*z in float32 on both sides: with logits of hundreds of units the two terms
    # cancel to ~1, leaving float32's rounding of the terms (~3e-5); a wrong term is off by whole units
    torch.testing.assert_close(ours.entropy, theirs.entropy, atol=1e-4, rtol=1e-5)
    assert ours.is_top1.dtype == torch.bool and ours.is_top1.equal(theirs.is_top1)
    assert ours.label_mask.equal(theirs.label_mask)
    # the entropy's gradient, -p * (log p + entropy), scales float32's rounding of log p (hundreds of
    # units here) into the gradient: both kernels are ~3e-6 of the scale from float64's, a wrong term 1
    _assert_same_grads(model, ref, noise=1e-5 if entropy_weight else FLOAT32_NOISE)


@pytest.mark.parametrize(
    "name, overrides",
    [("gemma2", dict(final_logit_softcapping=2.0)), ("cohere", dict(logit_scale=0.5)), ("llama", {})],
)
@pytest.mark.parametrize("temperature, cast", [(0.7, False), (1.0, True), (0.7, True)])
def test_every_trl_output_at_a_temperature_and_in_float32_matches_trl(name, overrides, temperature, cast):
    """TRL divides by the temperature after the family's scale and cap (a cap of 2 after a temperature of 0.7
    would give other logits); with cast_lm_head_to_fp32 both heads' matmuls run on float32 hidden states."""
    every = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    model, ref = _trl_pair(name, every, temperature, cast, **overrides)
    ids, labels = _batch()
    ours, theirs = (
        _run(m, ids, labels, 0.3, extra=lambda out: out.mean_logits.sum() + out.log_sum_sq_probs.sum())
        for m in (model, ref)
    )
    for field in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(
            getattr(ours, field), getattr(theirs, field), atol=1e-4, rtol=1e-5, msg=lambda m, f=field: f"{f}: {m}"
        )
    assert ours.is_top1.equal(theirs.is_top1)
    assert not ours.mean_logits.requires_grad and not ours.log_sum_sq_probs.requires_grad  # none in TRL's either
    # as above, with logits of hundreds of units divided by 0.7: a few 1e-5 of the scale, a wrong term 1
    _assert_same_grads(model, ref, noise=3e-5)


def test_top1_is_often_true_and_follows_the_first_argmax():
    """Targets set to each token's argmax (and to a tied later column) make top-1 true (and false)."""
    model, ref = _trl_pair("llama")
    ids, labels = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids, return_logits=True).logits
    best = logits.argmax(-1)
    labels = torch.cat([labels[:, :1], best[:, :-1]], dim=1)  # label t+1 = argmax at t
    labels[0, :4] = -100
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert out.is_top1[out.label_mask].all() and out.is_top1.sum() == out.label_mask.sum()
    assert out.is_top1.equal(ref(input_ids=ids, labels=labels, fused_lm_head=True).is_top1)


def test_shift_labels_and_num_items_in_batch_as_trl():
    model, ref = _trl_pair("llama")
    ids, labels = _batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    for kwargs in (dict(shift_labels=shift), dict(num_items_in_batch=torch.tensor(7))):
        ours, theirs = _run(model, ids, labels, 0.0, **kwargs), _run(ref, ids, labels, 0.0, **kwargs)
        torch.testing.assert_close(ours.loss, theirs.loss)
        torch.testing.assert_close(ours.log_probs, theirs.log_probs)
        _assert_same_grads(model, ref)


def test_without_fused_lm_head_the_forward_is_the_model_s_own():
    model, ref = _trl_pair("llama")
    ids, labels = _batch()
    ours, theirs = model(input_ids=ids, labels=labels, return_logits=True), ref(input_ids=ids, labels=labels)
    torch.testing.assert_close(ours.logits, theirs.logits)
    torch.testing.assert_close(ours.loss, theirs.loss)
