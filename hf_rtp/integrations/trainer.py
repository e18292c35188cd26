"""transformers.Trainer, and subclasses such as TRL's SFTTrainer, on a rotated model.

Trainer saves from the main process only and pickles the optimizer. On a rotated model that would
hang (save_pretrained is collective) or write rank 0's rows. hf_rtp therefore attaches itself to
the Trainer instance that moves a rotated model to its device, which every Trainer's __init__
does (see `adopt_caller`), and replaces five methods on that instance only; transformers itself
is not patched:

- save_model: the collective save_pretrained (every rank streams its rows to rank 0's files);
- _save_optimizer_and_scheduler / _load_optimizer_and_scheduler: model, optimizer and scheduler
  through torch.distributed.checkpoint in `checkpoint-N/hf_rtp_state`, which every rank writes
  and reads, so a resume is exact and works at another world size;
- _load_from_checkpoint / _load_best_model: each rank reads its own rows of the saved weights.

A PEFT model's adapters are replicated, so Trainer's own main-process adapter save stays.
TRL trainers also get hf_rtp's fused LM head (integrations.trl).
"""

from __future__ import annotations

import os
import sys
import types

import torch

from ..checkpoint.load import load_into
from ..checkpoint.resume import load_training_state, save_training_state
from ..log import warning
from ..state import state_of
from . import trl
from .accelerate import check_processes

STATE_DIR = "hf_rtp_state"
_REPLACED = ("save_model", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
             "_load_from_checkpoint", "_load_best_model")


def adopt_caller(model) -> None:
    """Attach to the Trainer whose `_move_model_to_device` is moving `model`, if one is."""
    frame = sys._getframe(1)
    for _ in range(32):  # Trainer -> (PEFT ->) nn.Module.to -> _apply recursion: a few frames up
        if frame is None:
            return
        if frame.f_code.co_name == "_move_model_to_device":
            from transformers import Trainer

            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                adopt(owner, model)
            return
        frame = frame.f_back


def adopt(trainer, model) -> None:
    """Make `trainer`'s saving and loading collective and data-parallel correct for rotated `model`."""
    check_processes(trainer.args.world_size, state_of(model).topology.world_size, "Trainer", "pass TrainingArguments(use_cpu=True)")
    if trainer.__dict__.get("_hf_rtp_adopted"):
        return
    for name in _REPLACED:
        setattr(trainer, name, types.MethodType(globals()[name], trainer))
    trl.adopt(trainer)  # SFTTrainer's fused LM head, installed after this __init__ step, through the ring
    trainer._hf_rtp_adopted = True


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _optimizer(trainer):
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper


def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    output_dir = output_dir or self.args.output_dir
    model = self.accelerator.unwrap_model(self.model)
    if _is_peft(model):  # replicated adapters: Trainer's main-process save is right
        return type(self).save_model(self, output_dir, _internal_call)
    model.save_pretrained(output_dir)  # collective
    if self.args.should_save:
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))  # as Trainer writes it
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    save_training_state(os.path.join(output_dir, STATE_DIR), self.model, _optimizer(self), self.lr_scheduler)


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    path = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(path):
        warning(f"{checkpoint} has no {STATE_DIR}: optimizer and scheduler start afresh (save_only_model?)")
        return
    load_training_state(path, self.model, _optimizer(self), self.lr_scheduler)


def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    model = model if model is not None else self.model
    if os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
        return  # the weights come back with the optimizer, from the same verified state
    if _is_peft(model):
        return type(self)._load_from_checkpoint(self, resume_from_checkpoint, model)
    load_into(model, resume_from_checkpoint)


def _load_best_model(self) -> None:
    model = self.accelerator.unwrap_model(self.model)
    if _is_peft(model):
        return type(self)._load_best_model(self)
    load_into(model, self.state.best_model_checkpoint)
