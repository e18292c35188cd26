"""The automatic plan, only when asked for (plan="auto"): rotate every Linear, Conv1D and Embedding
along dim 0 and replicate everything else. It suits decoder-only models whose projections are plain
modules; it logs what it chose so you can turn it into a registered plan.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from .. import log
from ..layers import LAYERS
from .base import Plan

AUTO_KINDS = ("linear", "conv1d", "embedding")


def auto_plan(model: nn.Module) -> Plan:
    rotate = {}
    for name, module in model.named_modules():
        for kind in AUTO_KINDS:
            if LAYERS[kind].fits(module):
                rotate[name] = kind
                break
    rotated_params = {f"{m}.{leaf}" for m, kind in rotate.items() for leaf in LAYERS[kind].rotated_leaves}
    replicate = tuple(
        n for n, _ in model.named_parameters(remove_duplicate=False) if n not in rotated_params and n.rpartition(".")[0] not in rotate
    )
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(rotate.values()).items()))
    log.warning(
        f"plan='auto' for {type(model).__name__}: rotating {len(rotate)} modules ({counts}): "
        f"{', '.join(rotate)}; replicating {len(replicate)} parameters: {', '.join(replicate)}"
    )
    return Plan(name="auto", rotate=rotate, replicate=replicate)
