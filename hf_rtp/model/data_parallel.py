"""Data-parallel glue: averaging the gradients of replicated parameters, keeping DDP off rotated ones, and
refusing an optimizer step over replicated gradients that nothing averaged.

Rotated parameters (DTensors) get the mean over every rank's batch from the ring itself. Replicated ones (norms,
routers, summed-partial biases, LoRA adapters) hold each rank's own gradient until DDP, `accelerator.prepare`
or `sync_grads` averages it (DESIGN.md I4). A plain loop that forgets to would step each rank's copy on its own
batch alone, and the ranks' copies would drift apart without a word, so the step is refused (`check_steps`).
Averaging inside the step instead would be a collective hidden in `optimizer.step()`, which ranks may call on
different optimizers or not at all, and would average twice under DDP.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import UnsyncedGradientsError
from ..private.torch_names import DDP_IGNORE_ATTRIBUTE, flatten_dense_tensors, unflatten_dense_tensors
from .state import ATTRIBUTE, RTPState, state_of


class _RotatedNames:
    """The names of `module`'s rotated parameters, listed when DDP reads them rather than when hf_rtp
    loaded the model: PEFT renames the layers it wraps (`q_proj.weight` -> `q_proj.base_layer.weight`).
    DDP reads the list from the module it wraps, through PEFT's attribute forwarding when that is a
    PeftModel, and matches names relative to it: each name is also listed under PEFT's prefix."""

    PREFIXES = ("", "base_model.model.")

    def __init__(self, module: nn.Module, on_read: Callable[[], None] | None = None):
        self.module, self.on_read = module, on_read

    def __iter__(self):
        state = state_of(self.module, required=False)
        if state is not None:  # DDP wraps the model: it averages the replicated gradients (check_steps)
            state.averaged_by_ddp = True
            for p in self.module.parameters():
                _PENDING.pop(p, None)
        if self.on_read is not None:  # who is wrapping the model (binding.bind: a plain Accelerator's prepare)
            self.on_read()
        names = [n for n, p in self.module.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
        return iter([prefix + name for prefix in self.PREFIXES for name in names])


def ignore_rotated_in_ddp(module: nn.Module, on_read: Callable[[], None] | None = None) -> None:
    """Tell DDP (so accelerate, Trainer and TRL too) to leave rotated parameters alone: the ring reduces them.

    from_pretrained does this for the model it returns, so a PEFT model around it needs no call either.
    `on_read` runs each time DDP reads the list, while it wraps the model.
    """
    setattr(module, DDP_IGNORE_ATTRIBUTE, _RotatedNames(module, on_read))


def sync_grads(model: nn.Module) -> None:
    """Average replicated parameters' gradients over all ranks, as DDP would, in one all-reduce per dtype.

    Rotated parameters already hold the mean (the ring, and on a 2-D grid the replicas, reduced them). Call it after
    backward in a plain loop (after the last micro-batch's, when accumulating); under DDP or `accelerator.prepare`
    the wrapper does this instead, so do not call both. At world size > 1, an optimizer step over replicated
    gradients that a backward made and neither this nor DDP averaged is refused (`check_steps`).
    """
    state = state_of(model, required=False)
    if state is None or state.topology.world_size == 1:
        return
    topology = state.topology
    params: list[nn.Parameter] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        grad = p.grad
        if grad is not None and not isinstance(p, DTensor):
            params.append(p)
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = flatten_dense_tensors(group)
        dist.all_reduce(flat, group=topology.group)
        flat.div_(topology.world_size)
        for g, synced in zip(group, unflatten_dense_tensors(flat, group), strict=True):
            g.copy_(synced)
    for p in params:
        _PENDING.pop(p, None)


# The step check's records, weak: nothing here keeps a model or a parameter alive.
_OWNERS = WeakIdKeyDictionary()
"""trainable replicated parameter of a rotated model at world size > 1 -> a weak reference to that model, once its
post-accumulate-grad hook (`_accumulated`) is registered"""
_PENDING = WeakIdKeyDictionary()
"""parameter -> None: a backward accumulated into its `.grad` since sync_grads last averaged it"""
_HOOK: list = []


def check_steps() -> None:
    """Once per process, at the first load at world size > 1 (loader.install_weights, before the step pre-hooks of
    integrations/bitsandbytes.py and torchao.py, so that a refused step has stepped no row): a step pre-hook that
    refuses `optimizer.step()` over replicated parameters of a rotated model whose gradients a backward made and
    nothing averaged (DESIGN.md, "Patches"). It returns at once while no such gradient exists anywhere (every
    step of a loop that syncs, and any under DDP), and for an optimizer that holds none of them."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def watch(model: nn.Module, backbone: nn.Module) -> None:
    """Record which replicated gradients a backward makes (binding.bind, at world size > 1): a post-accumulate-grad
    hook on each trainable replicated parameter of `model`, registered now and at each forward with autograd on
    (`backbone`'s, which every forward of the model runs), so that adapters PEFT adds after load are covered too.

    Only gradients that a backward accumulated count: one set by hand, or torch.distributed.checkpoint's zeros
    (it steps an optimizer with them to make its state), are the caller's business."""
    check_steps()
    owner = weakref.ref(model)  # the hook's closure must not keep the model alive

    def before_forward(module, args) -> None:
        found = owner()
        if found is not None and torch.is_grad_enabled():
            _hook_replicated(found, owner)

    _hook_replicated(model, owner)
    backbone.register_forward_pre_hook(before_forward)


def _hook_replicated(model: nn.Module, owner: weakref.ref) -> None:
    for p in model.parameters():
        if p.requires_grad and not isinstance(p, DTensor) and p not in _OWNERS:
            _OWNERS[p] = owner
            p.register_post_accumulate_grad_hook(_accumulated)


def _accumulated(param: torch.Tensor) -> None:
    """A backward accumulated into `param.grad`: this rank's part, until sync_grads averages it. Not under DDP,
    which averages it itself. (Clipping or GradScaler's unscale change the gradient in place too, but keep it
    averaged: hence a hook on accumulation, not the gradient's version counter.)"""
    owner = _OWNERS.get(param)
    model = owner() if owner is not None else None
    if model is not None and not model.__dict__[ATTRIBUTE].averaged_by_ddp:
        _PENDING[param] = None


def _before_step(optimizer, args, kwargs) -> None:
    # Refuse, never average here: an all-reduce inside optimizer.step() would be a collective the ranks did not
    # ask for (they may step different optimizers, or skip a step), and under DDP a second mean.
    if not _PENDING:
        return
    pending = [p for group in optimizer.param_groups for p in group["params"] if p in _PENDING and p.grad is not None]
    by_model: dict[int, tuple[nn.Module, set[int]]] = {}
    for p in pending:
        model = _OWNERS[p]()
        if model is not None and not model.__dict__[ATTRIBUTE].averaged_by_ddp:
            by_model.setdefault(id(model), (model, set()))[1].add(id(p))
    for model, ids in by_model.values():
        names = [name for name, p in model.named_parameters() if id(p) in ids]
        raise UnsyncedGradientsError(_refusal(optimizer, model, model.__dict__[ATTRIBUTE], names))


def _refusal(optimizer, model: nn.Module, state: RTPState, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    source = getattr(getattr(model, "config", None), "name_or_path", "")
    loaded = f" loaded from {source}" if source else ""
    return (
        f"{type(optimizer).__name__}.step(): {len(names)} replicated parameter(s) of the rotated "
        f"{type(model).__name__}{loaded} ({shown}) have gradients that were never averaged over the "
        f"{state.topology.world_size} ranks: no hf_rtp.sync_grads(model) since the backward that made them, and no "
        "DDP around the model. Each rank would step them on its own batch alone, and the ranks' copies would drift "
        "apart (the ring averages only the rotated parameters' gradients). Call hf_rtp.sync_grads(model) after "
        "backward (after the last micro-batch's, when accumulating gradients), or wrap the model in "
        "torch.nn.parallel.DistributedDataParallel or accelerator.prepare(model), which average them; not both. "
        "Nothing was stepped"
    )
