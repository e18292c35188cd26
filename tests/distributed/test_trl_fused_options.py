"""TRL's fused LM head with the options TRL 1.16's trainers ask for, on the ring at 2 ranks, against TRL's own
`add_fused_lm_head` on vanilla transformers in the same processes.

DPOTrainer asks for `mean_logits` (and `log_sum_sq_probs` with `use_weighting`), GRPOTrainer for a sampling
temperature and `cast_lm_head_to_fp32`. Before, each sent a rotated model to TRL's own head, which gathers the
whole head on every rank at every step (with a warning); now hf_rtp computes them as the head's pieces pass in
the ring. Each rank scores its own batch (a masked prompt; the head in pieces of a few rows, so the running sums
cross pieces and chunks); every per-token output equals TRL's on that batch, and the gradient of a loss built
from them equals DDP's mean of vanilla's over the ranks' batches. The head is scaled so that logits span several
units: a temperature, the head's dtype and each statistic then change the numbers visibly.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.compare import hf_rtp_records, rows
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("trl")

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
GATHERS = "gathers the whole head"
# (model dtype, temperature, cast_lm_head_to_fp32, under bf16 autocast)
CASES = [
    (torch.float64, 1.0, False, False),
    (torch.float64, 0.7, False, False),
    (torch.float64, 0.7, True, False),  # the head's matmul in float32 on both sides
    (torch.float32, 0.7, False, True),  # GRPO under bf16=True: the head's matmul in bf16 ...
    (torch.float32, 0.7, True, True),  # ... or, with cast_lm_head_to_fp32, in float32 outside autocast
]


def _labels(batch):
    labels = batch.clone()
    labels[:, :3] = -100  # a prompt
    return labels


def _objective(out):
    """What an entropy-regularised trainer differentiates; TRL gives the last two terms no gradient."""
    return out.loss + 0.3 * out.entropy.sum() + out.mean_logits.sum() + out.log_sum_sq_probs.sum()


def _head_file(model) -> str:
    return model.forward.__func__.__code__.co_filename


def _run_case(model, ref, batches, rank, temperature, cast, autocast):
    """Both fused heads installed with the same options, this rank's output beside vanilla's on the same batch;
    gradients accumulated as DDP's (vanilla's mean over the ranks' batches). The models' forwards are restored."""
    from trl.trainer import utils

    import hf_rtp
    from hf_rtp.integrations import trl

    forwards = model.forward, ref.forward
    options = dict(temperature=temperature, cast_lm_head_to_fp32=cast, outputs=OUTPUTS)
    trl.add_fused_lm_head(model, **options, original=utils.add_fused_lm_head)
    utils.add_fused_lm_head(ref, **options)
    on_the_ring = _head_file(model).endswith(os.path.join("hf_rtp", "integrations", "trl.py"))
    model.zero_grad(), ref.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(input_ids=batches[rank], labels=_labels(batches[rank]), fused_lm_head=True)
        ref_outs = [ref(input_ids=b, labels=_labels(b), fused_lm_head=True) for b in batches]
    _objective(out).backward()
    hf_rtp.sync_grads(model)
    torch.stack([_objective(o) for o in ref_outs]).mean().backward()
    model.forward, ref.forward = forwards
    return on_the_ring, out, ref_outs[rank]


def _assert_outputs_match(out, theirs, case):
    # float32 statistics on both sides (TRL's kernel upcasts the logits, as hf_rtp's does): ~1e-5 apart at logits
    # of tens of units; a temperature, a statistic or a head dtype other than TRL's is off by 4e-3 to 0.1
    for name in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(
            getattr(out, name), getattr(theirs, name), atol=1e-4, rtol=1e-5, msg=lambda m, n=name: f"{case} {n}: {m}"
        )
    assert out.is_top1.dtype == torch.bool and out.is_top1.equal(theirs.is_top1), case
    assert out.label_mask.equal(theirs.label_mask), case
    assert not out.mean_logits.requires_grad and not out.log_sum_sq_probs.requires_grad, case  # as TRL's
    assert out.log_probs.requires_grad and out.entropy.requires_grad, case


def _assert_grads_match(model, ref, world, rank, case):
    """Float64: float32 rounding of the two kernels, scaled by logits of tens of units into ~2e-5 of each
    gradient's scale. Under bf16 autocast the backbones' bf16 matmuls sum in another order (~1.3e-2); with
    cast_lm_head_to_fp32 the head's own gradient is float32 on both sides again (bf16 would be ~3e-3 off)."""
    _, _, cast, autocast = case
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        mine, expected = p.grad, theirs[name].grad
        if hasattr(mine, "to_local"):
            mine, expected = mine.to_local(), expected[rows(p, world, rank)]
        noise = 5e-5 if not autocast else 1e-4 if cast and name == "lm_head.weight" else 3e-2
        torch.testing.assert_close(
            mine,
            expected,
            atol=noise * theirs[name].grad.abs().max().item(),
            rtol=1e-5,
            msg=lambda m, name=name: f"{case} grad of {name}: {m}",
        )


def _against_trl(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), 2
    batches = global_batch(world, batch=2, seq=9)
    records = hf_rtp_records()
    models = {}
    for case in CASES:
        if case[0] not in models:
            models[case[0]] = (
                hf_rtp.from_pretrained(ckpt, dtype=case[0], rotation_piece_size="1KB").train(),
                AutoModelForCausalLM.from_pretrained(ckpt, dtype=case[0]).train(),
            )
        model, ref = models[case[0]]
        on_the_ring, out, theirs = _run_case(model, ref, batches, rank, *case[1:])
        assert on_the_ring, case
        _assert_outputs_match(out, theirs, case)
        _assert_grads_match(model, ref, world, rank, case)
    warned = [r.getMessage() for r in records if GATHERS in r.getMessage()]
    return warned, _still_gathered(models[torch.float64][0], records)


def _still_gathered(model, records):
    """An output TRL 1.16's kernel does not have (a later TRL's, say) still goes to TRL's own head, warned about."""
    from trl.trainer import utils

    from hf_rtp.integrations import trl

    trl.add_fused_lm_head(model, outputs=("log_probs", "top_k_log_probs"), original=utils.add_fused_lm_head)
    warned = [r.getMessage() for r in records if GATHERS in r.getMessage()]
    return warned, _head_file(model)


def _sharp_checkpoint(path) -> str:
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny("llama", path)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # logits of tens of units
    model.save_pretrained(ckpt)
    return ckpt


def test_temperature_fp32_head_mean_logits_and_log_sum_sq_probs_on_the_ring_equal_trl(tmp_path):
    results = run_on_ranks(_against_trl, 2, _sharp_checkpoint(tmp_path / "ckpt"))
    warned, (still_warned, head) = results[0]  # hf_rtp warns on rank 0 only
    assert warned == [], warned
    assert len(still_warned) == 1 and "['top_k_log_probs'], which hf_rtp does not compute" in still_warned[0]
    assert head.endswith(os.path.join("trl", "trainer", "utils.py"))
