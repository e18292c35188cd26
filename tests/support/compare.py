"""Comparing a rotated model with vanilla transformers on the global batch, in float64.

Float64, because Adam divides by sqrt(v) + eps: in float32 a gradient near 1e-8 turns
summation-order noise into a visible step difference. Some families still compute norms (and their
loss) in float32, so inputs that differ by float64 rounding (chunked matmuls block differently) can
round differently there: the tolerance is float32 rounding, about 100x tighter than a float32 comparison.
"""

from __future__ import annotations

import torch

ATOL, RTOL = 1e-8, 1e-6
LR = 1e-2
# Adam's first step is lr * g / (|g| + eps): a grad error d moves it by up to lr * d / eps. With
# eps = 1e-6 the float32-sized noise the grad check admits (d ~ 1e-11) moves a step by ~1e-7, far
# inside 0.1% of a step; a real fault (wrong chunk, wrong state) is off by a whole step.
ADAM_EPS = 1e-6
STEP_ATOL = LR * 1e-3
# Gradients through a family's float32 islands (Gemma 2 runs four float32 RMSNorms per layer) carry
# float32 rounding of a different summation order: ~1e-5 relative, where a wrong chunk is off by ~1
GRAD_ATOL, GRAD_RTOL = 1e-7, 1e-5
DTYPE = torch.float64


def rows(param, world, rank):
    from hf_rtp.sharding import chunk_rows

    return slice(*chunk_rows(param.shape[0], world, rank))


def assert_matches(model, ref, world, rank, what, atol=ATOL, rtol=RTOL):
    """Every parameter (or its grad) equals vanilla's; rotated ones as this rank's rows of it."""
    from torch.distributed.tensor import DTensor

    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        mine = p if what == "param" else p.grad
        theirs = ref_params[name] if what == "param" else ref_params[name].grad
        assert mine is not None and theirs is not None, f"{name}: missing {what}"
        if isinstance(p, DTensor):
            mine, theirs = mine.to_local(), theirs[rows(p, world, rank)]
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{what} of {name}: {m}")


def float64_loss(out, ids, config):
    """Next-token loss in float64 (plus the MoE auxiliary loss, as transformers adds it)."""
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + config.router_aux_loss_coef * out.aux_loss
    return loss
