"""The automatic plan, only when asked for (plan="auto"): rotate every module a layer kind reproduces
exactly (Linear, Conv1D, Embedding, fused experts) along dim 0 and replicate everything else. It suits
decoder-only models whose projections are plain modules; it logs what it chose, and what it kept
whole and why, so you can turn it into a registered plan.
"""

from __future__ import annotations

from collections import Counter

from torch import nn
from transformers.pytorch_utils import Conv1D

from .. import log
from ..layers import LAYERS
from .base import Plan

# kind -> the modules it is meant for; a candidate the kind cannot reproduce is kept whole, with why
AUTO_KINDS = {
    "linear": lambda m: isinstance(m, nn.Linear),
    "conv1d": lambda m: isinstance(m, Conv1D),
    "embedding": lambda m: isinstance(m, nn.Embedding),
    "experts": lambda m: "gate_up_proj" in m._parameters or type(m).__name__.endswith("Experts"),
}


def auto_plan(model: nn.Module) -> Plan:
    rotate, kept = {}, {}
    for name, module in model.named_modules():
        for kind, candidate in AUTO_KINDS.items():
            if not candidate(module):
                continue
            refusal = LAYERS[kind].refusal(module)
            if refusal is None:
                rotate[name] = kind
            else:
                kept[name] = refusal
            break
    rotated_params = {f"{m}.{leaf}" for m, kind in rotate.items() for leaf in LAYERS[kind].rotated_leaves}
    replicate = tuple(
        n
        for n, _ in model.named_parameters(remove_duplicate=False)
        if n not in rotated_params and n.rpartition(".")[0] not in rotate
    )
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(rotate.values()).items()))
    whole = "; ".join(f"{name} ({why})" for name, why in kept.items())
    log.warning(
        f"plan='auto' for {type(model).__name__}: rotating {len(rotate)} modules ({counts}): "
        f"{', '.join(rotate)}; replicating {len(replicate)} parameters: {', '.join(replicate)}"
        + (f"; kept whole because no layer kind reproduces them exactly: {whole}" if kept else "")
    )
    _warn_if_mostly_whole(model, replicate)
    return Plan(name="auto", rotate=rotate, replicate=replicate)


def _warn_if_mostly_whole(model: nn.Module, replicate: tuple[str, ...]) -> None:
    """The 1/N promise barely holds when most parameters stay whole: say so apart, with the biggest."""
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    whole = {n: sizes[n] for n in replicate if n in sizes}
    share = sum(whole.values()) / max(sum(sizes.values()), 1)
    if share > 0.5:
        biggest = sorted(whole, key=lambda n: whole[n], reverse=True)
        log.warning(
            f"plan='auto' keeps {share:.0%} of {type(model).__name__}'s parameters whole on every rank, so each rank "
            f"holds most of the model: {', '.join(biggest[:12])}"
            + (f" and {len(biggest) - 12} more" if len(biggest) > 12 else "")
            + ". Register a plan that rotates them (hf_rtp.plans.register), or load with plain data parallelism"
        )
