"""The gradients a Trainer's first optimizer step takes (after clipping), for comparing with vanilla."""

from __future__ import annotations

import torch


def first_grads_callback():
    """A TrainerCallback whose `.grads` holds, after the first step, every gradient by the model's own names
    (DDP's `module.` dropped), rotated ones whole; as numpy arrays, which cross a result queue safely."""
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        def __init__(self):
            self.grads = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                with torch.no_grad():
                    self.grads = {
                        n.removeprefix("module."): _numpy(
                            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                        )
                        for n, p in model.named_parameters()
                        if p.grad is not None
                    }

    return FirstGrads()


def _numpy(tensor: torch.Tensor):
    """numpy has no bfloat16: a bf16 or fp16 gradient (TRL casts QLoRA adapters to bf16) as float32, exactly."""
    return (tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor).numpy()
