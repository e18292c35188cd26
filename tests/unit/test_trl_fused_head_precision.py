"""How far TRL 1.16's own fused LM head and hf_rtp's are from float64, on the same float32 model and inputs.

GRPOTrainer and DPOTrainer score completions with `model(..., labels=labels, fused_lm_head=True).log_probs`
after `trl.trainer.utils.add_fused_lm_head` (GRPO: its temperature, `outputs=("log_probs", "entropy")`; DPO:
temperature 1 and the outputs its metrics read), under `accelerator.autocast()`. On a CPU TRL's
`ChunkedLogProbFunction` projects in the compute dtype, 32768 vocabulary rows at a time, and folds each tile
into float32 running sums; hf_rtp's head does the same math over its tiles and ring pieces. The chosen
tokens' log-probabilities three ways, at real tokenizers' vocabularies and logits of a trained model's size:
(a) TRL's own fused head on the vanilla model, called as the trainers call it; (b) hf_rtp's, which its
`add_fused_lm_head` installs on a rotated model, here a copy of the model with its head rotated on a ring of
one; (c) float64: the hidden states both heads were given and the head's weight in float64, divided by the
temperature, log_softmax, gather.

What holds (docs/integrations.md, "GRPO and DPO beside vanilla DDP"): in float32 both heads are within
float32 rounding of float64 (a few 1e-6 at logits up to 19), log-probs and gradients alike, and of each
other; neither is the inexact side. Under bf16 autocast (GRPOConfig's and DPOConfig's default `bf16=True`)
both project in bf16 and both are bf16 rounding away from float64 (3e-2 here), equally; GRPO's
`cast_lm_head_to_fp32=True` takes both back to float32's distance. How close each bf16 kernel is exactly
depends on the CPU, so that case asserts sizes only. The numbers are recorded (`record_property`, and
printed under `-s`).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from support.models import tiny_llama_config
from transformers import AutoModelForCausalLM

pytest.importorskip("trl")

# measured, both heads, with MKL and oneDNN limited to AVX512, AVX2 and SSE4.2 in turn: log-probs 1.8e-6 to 3.5e-6
# from float64, gradients 2.6e-7 to 1.4e-6 of their largest entry, the two heads' log-probs 0 to 3.8e-6 apart
FLOAT32_BOUND = 1e-5
# measured, both heads under bf16 autocast: log-probs 2.9e-2 from float64, gradients 9.7e-3 to 1.2e-2 (at an
# untrained head's logits, below 1, the log-probs are 9.6e-4 to 1.4e-3 off, where float32's are 9e-7 to 1.5e-6)
BF16_FLOOR = 1e-4
HEAD_SCALE = 22.6  # the head's init (std 0.02) scaled: logits up to 13 (19 at temperature 0.7), a trained LM's

GRPO = ("log_probs", "entropy")  # what GRPOTrainer asks of the policy's fused head
DPO = ("log_probs", "entropy", "mean_logits", "is_top1")  # DPOTrainer's (no WPO weighting)
CASES = [  # (vocabulary, temperature, outputs), as each trainer calls the head
    pytest.param(151936, 0.7, GRPO, id="grpo-qwen2-vocab-t0.7"),  # five of TRL's 32768-row tiles
    pytest.param(32000, 1.0, DPO, id="dpo-llama2-vocab"),
]


def _models(vocab: int):
    """A small float32 Llama with a realistic vocabulary: vanilla, and a copy whose head is rotated on a ring of
    one (hf_rtp's fused head runs on it as on N ranks, minus the transfers)."""
    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.layers import RotatedLinear

    config = tiny_llama_config(vocab_size=vocab, intermediate_size=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    vanilla = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        vanilla.lm_head.weight.mul_(HEAD_SCALE)
    # only the head and the final norm train: the hidden states' gradient without the embedding's (vocab x 32) one
    vanilla.model.requires_grad_(False)
    vanilla.model.norm.weight.requires_grad_(True)
    rotated = copy.deepcopy(vanilla)
    head = rotated.get_output_embeddings()
    rotated.set_output_embeddings(RotatedLinear(head, ring=Ring(None), weight=head.weight, bias=head.bias))
    return vanilla.train(), rotated.train()


def _inputs(vocab: int):
    """Two prompt-and-completion rows, the second completion padded, labelled as GRPOTrainer labels them."""
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -7:] = 0  # a shorter completion
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :16] = -100  # the prompt is not scored
    return ids, attention_mask, labels


def _score(model, ids, attention_mask, labels, autocast: bool, grads: bool):
    """GRPO's and DPO's call: per-token log-probs of the labels, with `grads` their sum's gradient at the head's
    weight and at the hidden states the head was given; and those hidden states."""
    seen = {}

    def keep(module, args, output):
        if grads:
            output.last_hidden_state.retain_grad()
        seen["hidden"] = output.last_hidden_state

    hook = model.model.register_forward_hook(keep)
    try:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grads):
            out = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        if grads:
            out.log_probs.sum().backward()
    finally:
        hook.remove()
    hidden = seen["hidden"]
    if not grads:
        return out.log_probs, None, None, hidden
    return out.log_probs.detach(), model.lm_head.weight.grad.clone(), hidden.grad[:, :-1].clone(), hidden.detach()


def _float64(hidden, weight, labels, temperature, grads: bool):
    """(c): the same hidden states and head weight in float64, log_softmax and gather (with both gradients); and
    the largest logit the heads saw, temperature applied."""
    h = hidden[:, :-1].double().requires_grad_(grads)
    w = weight.detach().double().requires_grad_(grads)
    targets = labels[:, 1:]
    mask = targets != -100
    logits = (h @ w.T) / temperature
    log_p = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    if grads:
        (log_p * mask).sum().backward()
    return log_p.detach() * mask, w.grad, h.grad, logits[mask].abs().max().item()


def _distance(found, expected, mask=None):
    found, expected = found.double(), expected.double()
    difference = (found - expected) if mask is None else (found - expected)[mask]
    return difference.abs().max().item()


def _run(vocab, temperature, outputs, autocast, grads, cast=False):
    from trl.trainer.utils import add_fused_lm_head

    from hf_rtp.integrations import trl

    vanilla, rotated = _models(vocab)
    # (a) as GRPOTrainer and DPOTrainer call it; (b) what hf_rtp's add_fused_lm_head installs on a rotated model
    add_fused_lm_head(vanilla, temperature=temperature, cast_lm_head_to_fp32=cast, outputs=outputs)
    trl.install(rotated, outputs, temperature, cast)
    trl_forward = vanilla.forward.__func__.__code__
    assert trl_forward.co_name == "_fused_forward" and trl_forward.co_filename.endswith(
        os.path.join("trl", "trainer", "utils.py")
    )
    ids, attention_mask, labels = _inputs(vocab)
    theirs = _score(vanilla, ids, attention_mask, labels, autocast, grads)
    ours = _score(rotated, ids, attention_mask, labels, autocast, grads)
    assert torch.equal(theirs[3], ours[3])  # the same hidden states (the backbones are copies): (c) serves both
    exact = _float64(theirs[3], vanilla.lm_head.weight, labels, temperature, grads)
    mask = labels[:, 1:] != -100
    errors = {}
    for name, (log_p, weight_grad, hidden_grad, _) in (("trl", theirs), ("hf_rtp", ours)):
        errors[name] = {"log_probs": _distance(log_p, exact[0], mask)}
        if grads:  # relative to the gradient's largest entry
            errors[name]["lm_head_grad"] = _distance(weight_grad, exact[1]) / exact[1].abs().max().item()
            errors[name]["hidden_grad"] = _distance(hidden_grad, exact[2]) / exact[2].abs().max().item()
    errors["trl_vs_hf_rtp"] = {"log_probs": _distance(theirs[0], ours[0], mask)}
    return errors, exact[3]


def _record(record_property, case, errors):
    for side, found in errors.items():
        for what, value in found.items():
            record_property(f"{case}:{side}:{what}", f"{value:.3e}")
    print(f"\n{case}: " + "; ".join(f"{s} {w} {v:.2e}" for s, f in errors.items() for w, v in f.items()))


@pytest.mark.parametrize("vocab, temperature, outputs", CASES)
def test_in_float32_trl_s_fused_head_and_hf_rtp_s_are_both_within_float32_rounding_of_float64(
    vocab, temperature, outputs, record_property
):
    errors, largest_logit = _run(vocab, temperature, outputs, autocast=False, grads=True)
    _record(record_property, f"float32 V={vocab} T={temperature} max|logit/T|={largest_logit:.1f}", errors)
    assert largest_logit > 10  # float32's rounding grows with the logits: these are a trained model's size
    for side in ("hf_rtp", "trl"):  # TRL's own head is as exact as hf_rtp's: neither is the inexact side
        for what, error in errors[side].items():
            assert error < FLOAT32_BOUND, (side, what, errors)
    # the same float32 math on both sides: the two heads' log-probs agree to float32 rounding too
    assert errors["trl_vs_hf_rtp"]["log_probs"] < FLOAT32_BOUND, errors


@pytest.mark.parametrize("cast", [False, True], ids=["bf16-head", "cast_lm_head_to_fp32"])
def test_under_bf16_autocast_both_heads_are_equally_far_from_float64(cast, record_property):
    """GRPOConfig's and DPOConfig's default (bf16=True): both heads project in bf16, so both log-probs are bf16
    rounding from float64, ten thousand times the float32 distance here, and of the same size. GRPO's
    cast_lm_head_to_fp32=True projects in float32 on both sides: both are within float32 rounding again."""
    vocab, temperature, outputs = CASES[0].values
    errors, largest_logit = _run(vocab, temperature, outputs, autocast=True, grads=True, cast=cast)
    case = f"bf16 autocast{', cast_lm_head_to_fp32' if cast else ''} V={vocab} T={temperature}"
    _record(record_property, f"{case} max|logit/T|={largest_logit:.1f}", errors)
    if cast:  # log-probs and gradients as in float32
        for side in ("hf_rtp", "trl"):
            for what, error in errors[side].items():
                assert error < FLOAT32_BOUND, (side, what, errors)
    else:
        for side in ("hf_rtp", "trl"):
            for what, error in errors[side].items():
                assert error > BF16_FLOOR, (side, what, errors)
        trl_error, ours = errors["trl"]["log_probs"], errors["hf_rtp"]["log_probs"]
        assert ours < 3 * trl_error and trl_error < 3 * ours, errors  # neither head is the inexact side
