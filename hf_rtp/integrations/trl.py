"""TRL: its fused LM head (SFTTrainer's `fused_lm_head=True` forward) through hf_rtp's rotated loss.

TRL's `add_fused_lm_head` gathers the whole LM head on every rank (`lm_head.weight.full_tensor()`)
and computes per-token log-probs, entropy and top-1 from it. On a rotated model that is correct
(hf_rtp gives the gather's gradient the data-parallel mean) but holds the full head and its gradient
on every rank. For a rotated model, `add_fused_lm_head` below installs a forward that returns the same
`FusedCausalLMOutput`, computed as the head's pieces pass in the ring (hf_rtp.layers.fused_loss).

SFTTrainer calls `add_fused_lm_head` after Trainer.__init__ has moved the model, which is where hf_rtp
adopts the trainer (integrations.trainer). Adoption points the name `add_fused_lm_head` in the
trainer's TRL modules at the function below, which hands every model that is not rotated, and every
option it does not reproduce, to TRL's own.
"""

from __future__ import annotations

import functools
import sys
import types

from .. import log
from ..fused_head import read_head, token_losses
from ..state import is_rotated

SUPPORTED_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks for
_ORIGINAL = "_hf_rtp_original"


def adopt(trainer) -> None:
    """Route `add_fused_lm_head` of every TRL module in `trainer`'s class hierarchy through hf_rtp."""
    for cls in type(trainer).__mro__:
        module = sys.modules.get(cls.__module__)
        original = getattr(module, "add_fused_lm_head", None)
        if cls.__module__.startswith("trl.") and original is not None and not hasattr(original, _ORIGINAL):
            routed = functools.wraps(original)(functools.partial(add_fused_lm_head, original=original))
            setattr(routed, _ORIGINAL, original)
            module.add_fused_lm_head = routed


def _why_not(model, temperature, cast_lm_head_to_fp32, outputs) -> str | None:
    if not set(outputs) <= set(SUPPORTED_OUTPUTS):
        return f"it asks for {sorted(set(outputs) - set(SUPPORTED_OUTPUTS))}, which hf_rtp does not compute"
    if temperature != 1.0 or cast_lm_head_to_fp32:
        return "it asks for a temperature or an fp32 head, which hf_rtp's loss does not apply"
    return read_head(model)[1]


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",), *, original) -> None:
    """TRL's `add_fused_lm_head`, with the rotated loss for rotated models (see the module docstring)."""
    if not is_rotated(model):
        return original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    reason = _why_not(model, temperature, cast_lm_head_to_fp32, outputs)
    if reason is not None:
        log.info(f"TRL's fused LM head gathers the whole head on every rank here, because {reason}")
        return original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    install(model, outputs)


def install(model, outputs: tuple[str, ...]) -> None:
    """Give `model`, whose head `read_head` accepts, TRL's `fused_lm_head=True` forward on the ring."""
    from trl.trainer.utils import FusedCausalLMOutput

    transforms, reason = read_head(model)
    if reason is not None:
        raise ValueError(f"hf_rtp cannot compute {type(model).__name__}'s fused LM head: {reason}")
    text_config = model.config.get_text_config()
    stats = "entropy" in outputs or "is_top1" in outputs
    plain_forward = model.forward

    @functools.wraps(type(model).forward)  # generate validates its kwargs against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return plain_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone = self.base_model(*args, **kwargs)
        hidden = backbone.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(hidden.device)
        mask = labels != -100
        results = token_losses(self, hidden[mask], labels[mask], text_config.vocab_size, transforms, stats=stats)
        nll, entropy, top1 = results if stats else (results, None, None)

        def spread(x):  # back to [batch, seq], zero where ignored; masked_scatter keeps an all-ignored batch in the graph
            return None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)

        log_probs = spread(-nll)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(backbone.router_logits, text_config.num_experts,
                                                text_config.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=spread(entropy) if "entropy" in outputs else None,
            is_top1=spread(top1) if "is_top1" in outputs else None, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)
