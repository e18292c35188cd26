"""The step check: an optimizer step over replicated gradients that a backward made and nothing averaged is refused.

Rotated parameters get the mean over every rank's batch from the ring. Replicated ones (norms, routers, adapters, a
PEFT prompt encoder, a user's wrapper's own layers) hold each rank's own gradient until DDP, `accelerator.prepare`
or `sync_grads` averages it (DESIGN.md I4). A plain loop that forgets to would step each rank's copy on its own
batch alone, and the copies would drift apart without a word, so the step is refused. Averaging inside the step
instead would be a collective hidden in `optimizer.step()`, which ranks may call on different optimizers or not at
all, and would average twice under DDP.

What is watched: each trainable replicated parameter of a rotated model at world size > 1, and of every module that
holds one (a PeftModel, a user's wrapper: data_parallel.py finds them as they are made), carries a post-accumulate-
grad hook that records the accumulation. Parameters added later are hooked at the next forward with autograd on,
and a parameter first seen then is made rank 0's on every rank first, as DDP makes a model's when it wraps it
(equal_copies.make_equal). A step with a closure (`optimizer.step(closure)`: SGD, LBFGS and some schedules) is checked
after the closure ran, since torch runs step pre-hooks before the step calls the closure.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import RotatedStateError, UnsyncedGradientsError
from . import equal_copies
from .state import ATTRIBUTE, RTPState, find_rotated

# The check's records, weak: nothing here keeps a model or a parameter alive.
_OWNERS = WeakIdKeyDictionary()
"""trainable replicated parameter -> a weak reference to the module that watches it (the rotated model, or a module
holding one), once its post-accumulate-grad hook (`_accumulated`) is registered"""
_PENDING = WeakIdKeyDictionary()
"""parameter -> None: a backward accumulated into its `.grad` since sync_grads last averaged it"""
_UNDER_DDP = WeakIdKeyDictionary()
"""parameter -> None: DDP wraps a module that holds it (it read that module's ignore list), so DDP averages it"""
_HOOK: list = []


def check_steps() -> None:
    """Once per process, at the first load at world size > 1 (loader.install_weights, before the step pre-hooks of
    integrations/bitsandbytes.py and torchao.py, so that a refused step has stepped no row): the step pre-hook
    (`_before_step`). It returns at once while no unaveraged gradient exists anywhere (every step of a loop that
    syncs, and any under DDP) and the step has no closure, and for an optimizer that holds none of them."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def watch(module: nn.Module, at: nn.Module, topology) -> None:
    """Watch the replicated gradients of `module` (a rotated model, or a module holding one): its trainable
    replicated parameters now, and at each forward of `at` with autograd on (the rotated model's backbone, which
    every forward of it runs; a holder's own forward), those added since, made rank 0's first (`topology`'s)."""
    check_steps()
    owner = weakref.ref(module)  # the hook's closure must not keep the module alive
    _hook_replicated(module, owner)

    def before_forward(_, args) -> None:
        found = owner()
        if found is not None and torch.is_grad_enabled():
            new = _hook_replicated(found, owner)
            if new:
                equal_copies.make_equal(found, new, topology)

    at.register_forward_pre_hook(before_forward)


def averaged_by_ddp(module: nn.Module) -> None:
    """DDP wraps `module` (it is reading its ignore list): DDP averages every gradient of it from now on."""
    for p in module.parameters():
        _UNDER_DDP[p] = None
        _PENDING.pop(p, None)


def averaged(params) -> None:
    """sync_grads averaged these parameters' gradients."""
    for p in params:
        _PENDING.pop(p, None)


def _hook_replicated(module: nn.Module, owner: weakref.ref) -> list[nn.Parameter]:
    new = []
    for p in module.parameters():
        if p.requires_grad and not isinstance(p, DTensor) and p not in _OWNERS:
            _OWNERS[p] = owner
            p.register_post_accumulate_grad_hook(_accumulated)
            new.append(p)
    return new


def _accumulated(param: torch.Tensor) -> None:
    """A backward accumulated into `param.grad`: this rank's part, until sync_grads averages it. Not under DDP,
    which averages it itself. (Clipping or GradScaler's unscale change the gradient in place too, but keep it
    averaged: hence a hook on accumulation, not the gradient's version counter.)"""
    if param not in _UNDER_DDP:
        _PENDING[param] = None


def _before_step(optimizer, args, kwargs):
    if isinstance(optimizer, torch.optim.LBFGS) and _holds_rotated(optimizer):
        raise RotatedStateError(_LBFGS_REFUSED)
    # torch hands a step pre-hook the step's own arguments, the optimizer first: (optimizer, closure) or closure=
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is None:
        _refuse_unaveraged(optimizer)
        return None
    # torch calls step pre-hooks before the step calls the closure, which makes this step's gradients: check after it
    checked = functools.partial(_closure_then_check, closure, optimizer)
    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


def _closure_then_check(closure, optimizer):
    loss = closure()
    _refuse_unaveraged(optimizer)
    return loss


def _refuse_unaveraged(optimizer) -> None:
    # Refuse, never average here: an all-reduce inside optimizer.step() would be a collective the ranks did not
    # ask for (they may step different optimizers, or skip a step), and under DDP a second mean.
    if not _PENDING:
        return
    pending = [p for group in optimizer.param_groups for p in group["params"] if p in _PENDING and p.grad is not None]
    by_owner: dict[int, tuple[nn.Module, set[int]]] = {}
    for p in pending:
        module = _OWNERS[p]()
        if module is not None:
            by_owner.setdefault(id(module), (module, set()))[1].add(id(p))
    for module, ids in by_owner.values():
        names = [name for name, p in module.named_parameters() if id(p) in ids]
        model = find_rotated(module)  # a holder may keep it under any name (a wrapper's `backbone`)
        assert model is not None  # only modules holding a rotated model are watched
        raise UnsyncedGradientsError(_refusal(optimizer, module, model.__dict__[ATTRIBUTE], names))


def _holds_rotated(optimizer) -> bool:
    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


_LBFGS_REFUSED = (
    "LBFGS over a rotated model's parameters: LBFGS flattens every parameter's gradient into one vector and takes "
    "dot products over it, and each rank holds only its rows of every rotated parameter (uneven ones do not even "
    "flatten). Use a first-order optimizer (torch.optim.AdamW, Adam or SGD; Trainer: optim='adamw_torch'); "
    "a closure works with them (`optimizer.step(closure)`), checked like any step. Nothing was stepped"
)


def _refusal(optimizer, module: nn.Module, state: RTPState, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    model = next((m for m in module.modules() if ATTRIBUTE in m.__dict__), module)
    source = getattr(getattr(model, "config", None), "name_or_path", "")
    loaded = f" loaded from {source}" if source else ""
    held = "" if model is module else f", held by a {type(module).__name__}"
    return (
        f"{type(optimizer).__name__}.step(): {len(names)} replicated parameter(s) of the rotated "
        f"{type(model).__name__}{loaded}{held} ({shown}) have gradients that were never averaged over the "
        f"{state.topology.world_size} ranks: no hf_rtp.sync_grads(model) since the backward that made them, and no "
        "DDP around the model. Each rank would step them on its own batch alone, and the ranks' copies would drift "
        "apart (the ring averages only the rotated parameters' gradients). Call hf_rtp.sync_grads(model) after "
        "backward (after the last micro-batch's, when accumulating gradients; inside the closure, with "
        "optimizer.step(closure)), or wrap the model in torch.nn.parallel.DistributedDataParallel or "
        "accelerator.prepare(model), which average them; not both. Nothing was stepped"
    )
