"""transformers.Trainer, and subclasses such as TRL's SFTTrainer, on a rotated model.

Trainer saves from the main process only and pickles the optimizer. On a rotated model that would
hang (save_pretrained is collective) or write rank 0's rows. `attach_trainer(trainer)` therefore
replaces five methods on that Trainer instance only (transformers itself is not patched), after
checking that the installed transformers declares them as the tested versions do:

- save_model: the collective save_pretrained (every rank streams its rows to rank 0's files), then
  Trainer's own `_save` for the rest (processing class or the collator's tokenizer, training args);
- _save_optimizer_and_scheduler / _load_optimizer_and_scheduler: model, optimizer and scheduler
  through torch.distributed.checkpoint in `checkpoint-N/hf_rtp_state`, which every rank writes
  and reads, so a resume is exact and works at another world size;
- _load_from_checkpoint / _load_best_model: each rank reads its own rows of the saved weights.

A PEFT model's adapters are replicated, so Trainer's own main-process adapter save stays.
TRL trainers also get hf_rtp's fused LM head (integrations.trl).

Attachment is automatic when Trainer.__init__ moves the model to its device (`adopt_caller`, called
from the model's `.to()`). A Trainer that does not (place_model_on_device=False, bf16_full_eval or
fp16_full_eval) is found at its first forward (`check_attached`) and attached then, before any save;
call `hf_rtp.attach_trainer(trainer)` right after building it to attach it before anything else.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types
from collections.abc import Callable

import transformers
from torch import nn

from ..checkpoint.load import load_into
from ..distributed.tensors.rotated import COMPILE_REFUSED
from ..errors import CheckpointError, IntegrationError, RotatedStateError, SettingError
from ..log import warning
from ..model import context
from ..model.state import rotated_module, state_of
from ..private.transformers_names import TESTED, check_trainer_methods_version
from ..training_state import load_training_state, save_training_state
from . import trl
from .accelerate import adopt_for_trainer, check_processes
from .peft import adapter_state_dict

STATE_DIR = "hf_rtp_state"
# The Trainer methods hf_rtp replaces, with the parameters they have in the tested versions
_REPLACED = {
    "save_model": ["self", "output_dir", "_internal_call"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
    "_load_best_model": ["self"],
}
_ATTACHED = "_hf_rtp_attached"
# Trainer methods that call the model's forward: where `check_attached` looks for an unattached Trainer
_CALLERS = (
    "compute_loss",
    "prediction_step",
    "training_step",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "concatenated_forward",
)


_REFUSED_OPTIMIZERS = ("adafactor",)
# Trainer methods wrapped (the trainer class's own runs inside) on a rotated model whose ring could run context
# parallelism: the loss convention and what Trainer cannot compute on a rank's chunks
_CONTEXT_PARALLEL = ("compute_loss", "prediction_step")


def attach_trainer(trainer, load: Callable[..., nn.Module]):
    """Make `trainer` save, resume and load its rotated model collectively and data-parallel correctly.

    Automatic when Trainer.__init__ moves the model to its device; call it yourself right after building a
    Trainer that does not (place_model_on_device=False, bf16_full_eval=True, fp16_full_eval=True). Raises
    IntegrationError when the installed transformers declares the replaced methods differently from the
    tested versions. Returns `trainer`. `load` is hf_rtp.from_pretrained, handed down by the layer that defines
    it: TRL's reference model is loaded with it, like the policy (integrations/trl.py).
    """
    return _attach(trainer, getattr(trainer, "model", None), load)


def _attach(trainer, model, load: Callable[..., nn.Module]):
    """attach_trainer, for `model`: while Trainer.__init__ moves it, `trainer.model` is not set yet."""
    if trainer.__dict__.get(_ATTACHED):
        return trainer
    if model is None or rotated_module(model) is None:
        raise IntegrationError(f"{type(trainer).__name__}.model holds no model loaded with hf_rtp.from_pretrained")
    check_processes(
        trainer.args.world_size,
        state_of(model).topology.world_size,
        "Trainer",
        "pass TrainingArguments(use_cpu=True) (--use_cpu on an example script's command line) and launch with "
        "torchrun --nproc_per_node N",
    )
    if state_of(model).topology.world_size > 1:  # refused at construction, not at the first step
        if getattr(trainer.args, "torch_compile", False):
            raise RotatedStateError(COMPILE_REFUSED)
        optim = getattr(trainer.args, "optim", None)
        optim = getattr(optim, "value", optim)  # an OptimizerNames member, or its string
        if optim in _REFUSED_OPTIMIZERS:
            raise RotatedStateError(
                f"TrainingArguments(optim={optim!r}) is not supported with a rotated model: Adafactor's "
                "factored second moment averages over all rows of a weight, and each rank holds only its rows. Use "
                "optim='adamw_torch' (or another torch optimizer)"
            )
    _check_versions(type(trainer))
    for name in _REPLACED:
        setattr(trainer, name, types.MethodType(globals()[name], trainer))
    if state_of(model).topology.ring.size > 1:  # context parallelism is possible: Trainer's side of it
        for name in _CONTEXT_PARALLEL:
            setattr(trainer, name, types.MethodType(globals()[f"_{name}"], trainer))
    if getattr(trainer, "accelerator", None) is not None:  # evaluate() before any train() prepares no DDP
        adopt_for_trainer(trainer.accelerator)
    trl.adopt(trainer, load, rotated_module(model))  # SFTTrainer's fused LM head, installed after this __init__ step
    trl.replace_installed_head(rotated_module(model))  # or installed already, by a Trainer attached late
    trainer.__dict__[_ATTACHED] = True
    return trainer


def _check_versions(cls) -> None:
    check_trainer_methods_version()  # an older transformers is refused, a newer one warned about (private/gate.py)
    problems = []
    for name, expected in _REPLACED.items():
        found = list(inspect.signature(getattr(cls, name)).parameters) if hasattr(cls, name) else None
        if found != expected:
            problems.append(f"{cls.__name__}.{name} takes {found}, hf_rtp's replacement {expected}")
    if problems:
        raise IntegrationError(
            "hf_rtp cannot attach to this Trainer: " + "; ".join(problems) + ". Install a tested transformers "
            f"({TESTED}), or save with model.save_pretrained and hf_rtp.save_training_state in "
            "your own loop"
        )


def adopt_caller(model, load: Callable[..., nn.Module]) -> None:
    """Attach to the Trainer whose `_move_model_to_device` is moving `model`, if one is (the automatic path:
    every Trainer that places its model does it in __init__, before TRL installs its fused head)."""
    trainer = _trainer_in_stack(("_move_model_to_device",), depth=32)
    if trainer is not None:
        _attach(trainer, model, load)


def check_attached(load: Callable[..., nn.Module]) -> None:
    """At a forward: a Trainer calling it that was never attached (it did not place the model in __init__)
    is attached now, before it can save or resume; it is never left to save rank 0's rows."""
    trainer = _trainer_in_stack(_CALLERS, depth=40)
    if trainer is not None and not trainer.__dict__.get(_ATTACHED):
        warning(
            f"{type(trainer).__name__} was not attached to hf_rtp when it was built (it did not move the model "
            "to its device); attaching it at its first forward. Call hf_rtp.attach_trainer(trainer) after building it"
        )
        attach_trainer(trainer, load)
        config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
        if config is not None and config.cp_enabled:  # this call began before its Trainer's side was in place
            raise SettingError(
                f"{type(trainer).__name__} under context parallelism was attached to hf_rtp only at its first forward "
                "(it did not move the model to its device: place_model_on_device=False, bf16_full_eval or "
                "fp16_full_eval), after this step's context-parallel block and loss had begun without it. Call "
                "hf_rtp.attach_trainer(trainer) right after building the Trainer"
            )


def refuse_unattached_save(world_size: int) -> None:
    """At a save_pretrained: a Trainer saving through its own main-process-only `_save` was never attached, so
    the other ranks are not saving with it. Refused at once, rather than a wait for ranks that never come."""
    trainer = _trainer_in_stack(("_save",), depth=8) if world_size > 1 else None
    if trainer is not None and not trainer.__dict__.get(_ATTACHED):
        raise IntegrationError(
            f"{type(trainer).__name__} saves the rotated model from its main process only: it was never attached to "
            "hf_rtp (it did not move the model to its device). Call hf_rtp.attach_trainer(trainer) after building it"
        )


def _trainer_in_stack(names: tuple[str, ...], depth: int):
    """The Trainer whose method named in `names` is on the stack within `depth` frames, if any."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in names:
            owner = frame.f_locals.get("self")
            if isinstance(owner, transformers.Trainer):
                return owner
        frame = frame.f_back
    return None


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _optimizer(trainer):
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper


def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    output_dir = output_dir or self.args.output_dir
    model = self.accelerator.unwrap_model(self.model)
    if _is_peft(model):
        state_dict = adapter_state_dict(model)  # collective: rotated modules_to_save copies, gathered
        if state_dict is None:  # replicated adapters only: Trainer's main-process save is right
            return type(self).save_model(self, output_dir, _internal_call)
        if self.args.should_save:
            type(self)._save(self, output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None
    model.save_pretrained(output_dir)  # collective
    if self.args.should_save:  # the rest as Trainer writes it: processing class or collator's tokenizer, args
        rotated = rotated_module(model)
        assert rotated is not None  # attach_trainer checked that the model is rotated
        collective = rotated.__dict__["save_pretrained"]
        rotated.__dict__["save_pretrained"] = lambda *args, **kwargs: None  # written above, by every rank
        try:
            type(self)._save(self, output_dir)
        finally:
            rotated.__dict__["save_pretrained"] = collective
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    save_training_state(os.path.join(output_dir, STATE_DIR), self.model, _optimizer(self), self.lr_scheduler)


# what transformers' Trainer writes for the optimizer and scheduler: optimizer.pt or .bin, an FSDP or accelerate
# optimizer_0/ folder, XLA's rank*-of-N-optimizer.pt, and scheduler.pt (transformers.trainer's OPTIMIZER_NAME,
# OPTIMIZER_NAME_BIN, SCHEDULER_NAME): pickles or torch.distributed.checkpoint of another layout, never loaded here
_PICKLED_STATE = re.compile(r"(optimizer(\.pt|\.bin|_\d+)|rank\d+-of-\d+-optimizer\.pt|scheduler\.pt)")


def _refuse_pickled_state(checkpoint: str) -> None:
    """A checkpoint a Trainer wrote without hf_rtp: vanilla would resume its optimizer and scheduler from it; hf_rtp
    cannot, and a resume without them would go on at its step with the moments and the schedule restarted."""
    if os.path.isdir(os.path.join(checkpoint, STATE_DIR)) or not os.path.isdir(checkpoint):
        return
    found = sorted(name for name in os.listdir(checkpoint) if _PICKLED_STATE.fullmatch(name))
    if found:
        raise CheckpointError(
            f"{checkpoint} holds {' and '.join(found)}, the optimizer and scheduler state transformers' Trainer "
            f"writes, and no {STATE_DIR}: it was written without hf_rtp. hf_rtp does not load them, and resuming "
            "without them would go on at its step with the optimizer's moments and the learning-rate schedule "
            "restarted. Resume from a checkpoint a Trainer wrote on the hf_rtp model, or start a new run from its "
            "weights: hf_rtp.from_pretrained(checkpoint), without resume_from_checkpoint"
        )


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    _refuse_pickled_state(checkpoint)
    path = os.path.join(checkpoint, STATE_DIR)
    if not os.path.isdir(path):  # as vanilla, which loads nothing where it saved no optimizer
        warning(f"{checkpoint} has no {STATE_DIR}: optimizer and scheduler start afresh (save_only_model?)")
        return
    load_training_state(path, self.model, _optimizer(self), self.lr_scheduler)


def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
    model = model if model is not None else self.model
    _refuse_pickled_state(resume_from_checkpoint)  # before the weights: nothing is loaded from it
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


def _compute_loss(self, model, inputs, *args, **kwargs):
    """The trainer class's own compute_loss; inside a context-parallel block, with Trainer's convention for the
    loss declared to the block, and the options that compute the loss outside the model refused.

    Trainer follows torch's context parallelism: when it passes its count of label tokens (divided by cp_size)
    it takes each rank's loss as its share (and, with average_tokens_across_devices, multiplies it by the
    processes; without, its count is a ring's divided by cp_size). A forward in hf_rtp's block returns
    the whole sequence's loss (model/context/loss.py); `context.shares` makes it the ring's mean of the shares for
    this call, whose gradient is each rank's share's: Trainer's step and logged loss are then vanilla's."""
    own = type(self).compute_loss
    run = context.active(rotated_module(model) or model)
    if run is None:
        return own(self, model, inputs, *args, **kwargs)
    _refuse_loss_outside_the_model(self, model)
    if self.__dict__.get(_PREDICTING):
        raise SettingError(_NO_PREDICTIONS.format(type(self).__name__))
    counted = (kwargs["num_items_in_batch"] if "num_items_in_batch" in kwargs else (args[1:2] or [None])[0]) is not None
    with context.shares(run, counted and bool(getattr(self, "model_accepts_loss_kwargs", False))):
        return own(self, model, inputs, *args, **kwargs)


def _refuse_loss_outside_the_model(self, model) -> None:
    """Trainer's options that compute the loss from the logits, or change the embeddings' noise by the sequence's
    length: on a rank's chunks each gives another model than vanilla's, so every rank refuses them at the first
    forward, before any step (their settings are the same on every rank)."""
    found = []
    if getattr(self, "label_smoother", None) is not None:
        found.append(
            f"label_smoothing_factor={self.args.label_smoothing_factor} (LabelSmoother shifts the labels "
            "within a rank's chunks and divides by its own count)"
        )
    if getattr(self, "compute_loss_func", None) is not None:
        found.append("compute_loss_func (it gets this rank's logits, chunks r and 2N-1-r)")
    strategy = getattr(self.args, "eval_strategy", "no")
    evaluates = str(getattr(strategy, "value", strategy)) != "no" and getattr(self, "compute_metrics", None)
    if model.training and evaluates and type(self).prediction_step is transformers.Trainer.prediction_step:
        found.append(
            "compute_metrics with an evaluation during training (its predictions would be each rank's chunks of logits)"
        )
    if model.training and getattr(self, "neftune_noise_alpha", None) is not None:
        found.append(
            f"neftune_noise_alpha={self.neftune_noise_alpha} (its noise is scaled by the rank's own "
            "sequence length, sqrt(N) wider than vanilla's)"
        )
    if found:
        raise SettingError(
            f"{type(self).__name__} under context parallelism does not support " + "; ".join(found) + ". The model's "
            "loss under context parallelism is the sequence's cross-entropy (model/context/loss.py): drop these "
            "options, or train without cp_size"
        )


_PREDICTING = "_hf_rtp_predicting"
_NO_PREDICTIONS = (
    "{} under context parallelism computes the evaluation loss only: its predictions would be each rank's chunks "
    "of the sequence, which Trainer gathers from every rank of every ring as if they were sequences. Evaluate "
    "without compute_metrics (or with prediction_loss_only=True); for logits in your own loop, call "
    "hf_rtp.context_parallel_unshard inside the block"
)


def _prediction_step(self, model, inputs, prediction_loss_only, *args, **kwargs):
    """The trainer class's own prediction_step, remembering whether it wants predictions: a forward of it inside a
    context-parallel block is refused then (`_compute_loss`). Outside a block (a batch without labels, or a trainer
    whose prediction_step never cuts the batch, as TRL's SFTTrainer's) each rank's predictions are whole."""
    self.__dict__[_PREDICTING] = not prediction_loss_only
    try:
        return type(self).prediction_step(self, model, inputs, prediction_loss_only, *args, **kwargs)
    finally:
        self.__dict__[_PREDICTING] = False
