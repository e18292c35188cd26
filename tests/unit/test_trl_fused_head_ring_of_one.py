"""hf_rtp's `fused_lm_head=True` forward for TRL on a ring of one, against TRL's own fused head on the
vanilla model in the same process: the loss, every per-token output SFTTrainer reads (log-probs,
entropy, top-1, label mask), and every gradient, including one through the entropy. Float64, logits
of several units so that soft-capping and scaling matter. Multi-rank: tests/distributed/test_trl.py.
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


def _trl_pair(name, **overrides):
    from trl.trainer.utils import add_fused_lm_head

    from hf_rtp.integrations import trl

    model, ref = _pair(name, **overrides)
    trl.install(model, OUTPUTS)
    add_fused_lm_head(ref, outputs=OUTPUTS)
    return model, ref


def _run(model, ids, labels, entropy_weight, **kwargs):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True, **kwargs)
    # an entropy term in the loss, as entropy-regularised trainers have: its gradient must be right too
    (out.loss + entropy_weight * out.entropy.sum()).backward()
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
