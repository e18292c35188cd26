"""Which of a model's parameters are ties (lm_head -> embed_tokens when the config ties them)."""

from __future__ import annotations

from torch import nn


def tie_targets(model: nn.Module) -> dict[str, str]:
    """target -> source for the weights this model ties (lm_head -> embed_tokens when tied)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {t: s for t, s in tied.items() if t in names and s in names}
