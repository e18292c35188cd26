"""`bind`, the one place that attaches anything to a loaded model: its state, the collective methods, the DDP
ignore list, Trainer adoption and the meeting at each forward."""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

from . import faults
from .checkpoint.pretrained import push_to_hub, save_pretrained
from .distributed.tensors.rotated import COMPILE_REFUSED, keep_rotated
from .errors import RotatedStateError
from .integrations.accelerate import adopt_caller as adopt_accelerator
from .integrations.accelerate import check_accelerate_state
from .integrations.peft import install_when_peft_is_imported
from .integrations.trainer import adopt_caller, check_attached, refuse_unattached_save
from .model import traffic
from .model.data_parallel import ignore_rotated_in_ddp, watch_holders
from .model.generation import generate
from .model.heads import is_causal_lm
from .model.state import ATTRIBUTE, RTPState
from .model.step_check import watch
from .model.vocabulary import resize_token_embeddings


def bind(model: nn.Module, state: RTPState, load: Callable[..., nn.Module]) -> nn.Module:
    """Everything hf_rtp attaches to a loaded model: its state, the collective save/push/generate, the
    DDP ignore list (and adoption of a plain Accelerator that wraps it in DDP), Trainer adoption on `.to()`, the
    guard that makes ranks meet at each forward, and the check of optimizer steps over its replicated gradients.
    `load` (from_pretrained) goes down to a Trainer's attachment, which loads TRL's reference model with it."""
    object.__setattr__(model, ATTRIBUTE, state)  # not a submodule, not in state_dict
    _attach(model, "save_pretrained", _save_pretrained)
    _attach(model, "push_to_hub", push_to_hub)
    _attach(model, "resize_token_embeddings", resize_token_embeddings)
    if is_causal_lm(model):
        _attach(model, "generate", generate)
    if getattr(model, "is_quantized", False):
        _attach(model, "dequantize", _refuse_dequantize)
    # DDP reads the names to ignore while a plain Accelerator's prepare wraps the model: adopt that Accelerator
    ignore_rotated_in_ddp(model, on_read=lambda: adopt_accelerator(model))

    def _apply(self, fn, recurse=True):  # every Trainer moves its model to a device in __init__
        adopt_caller(self, load)
        applied = type(self)._apply(self, fn, recurse)
        keep_rotated(self)
        return applied

    _attach(model, "_apply", _apply)
    if state.topology.world_size > 1:
        _attach(model, "compile", _refuse_compile)  # torch.compile(model) is refused at its first trace
        # The backbone, not the model itself: PEFT and TRL call the model's forward directly, which
        # skips the model's hooks, but every causal LM calls its backbone as a module.
        backbone = getattr(model, "base_model", None) or model
        # the model's logits_to_keep (how many of each sequence's last tokens its LM head sees: generate's decode
        # and assisted steps), which the backbone's forward is not given; unknown (every token) where the model's
        # own hooks are skipped
        keep: dict = {}
        if backbone is not model:
            model.register_forward_pre_hook(
                lambda module, args, kwargs: keep.update(logits_to_keep=kwargs.get("logits_to_keep")), with_kwargs=True
            )
        backbone.register_forward_pre_hook(
            lambda module, args, kwargs: _before_forward(state, load, args, kwargs, keep.pop("logits_to_keep", None)),
            with_kwargs=True,
        )

        def _after_forward(*_) -> None:  # also when it raised: ops outside a forward move weights
            keep.clear()
            traffic.clear(state.topology.ring)

        # after the model's forward (its LM head included)
        model.register_forward_hook(_after_forward, always_call=True)
        install_when_peft_is_imported()  # process-wide, until PEFT knows the `rtp` mesh
        watch(model, backbone, state.topology)  # a step over replicated gradients that nothing averaged is refused
        watch_holders()  # and any module that takes the model in: DDP's ignore list and the same watch
    return model


def _attach(model: nn.Module, name: str, function) -> None:
    """`function` as `model`'s own method `name`, on this instance only (the class is untouched)."""
    setattr(model, name, types.MethodType(function, model))


def _refuse_dequantize(model, *args, **kwargs):
    raise RotatedStateError(
        "dequantize() of a rotated 4-bit or 8-bit base is not supported: transformers' dequantize replaces "
        "bitsandbytes' own modules, and each rank holds only its rows of hf_rtp's. Load the checkpoint without "
        "quantization_config for float weights, or train adapters on the quantized base"
    )


def _refuse_compile(model, *args, **kwargs):
    raise RotatedStateError(COMPILE_REFUSED)


def _save_pretrained(model, *args, **kwargs):
    """checkpoint.save.save_pretrained, refused when an unattached Trainer calls it from its main process only."""
    refuse_unattached_save(model.__dict__[ATTRIBUTE].topology.world_size)
    return save_pretrained(model, *args, **kwargs)


def _before_forward(state: RTPState, load: Callable[..., nn.Module], args: tuple, kwargs: dict, keep=None) -> None:
    # An Accelerator built after from_pretrained can still have come up undistributed: its prepare
    # never tells us, its first forward does. A dict lookup when accelerate is not in use.
    check_accelerate_state(state.topology.world_size)
    check_attached(load)  # a Trainer that never placed the model is attached here, before it saves
    faults.point("forward")
    ring = state.topology.ring
    # the meeting also settles what this forward's rotated ops move (model.traffic)
    traffic.agree(ring, state.topology.enter("forward", traffic.payload(ring, args, kwargs, keep)))
