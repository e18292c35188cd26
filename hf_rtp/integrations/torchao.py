"""torchao's 8-bit optimizers (`torchao.optim.AdamW8bit`, `Adam8bit`) over rotated parameters: each rank steps
its own rows with torchao's own compiled step and keeps only its rows' 8-bit state.

torchao keeps an 8-bit moment as uint8 codes in the parameter's shape plus one float32 scale per `block_size`
(256) elements of the flattened tensor, and its step (`single_param_adam`, compiled per shape) updates each
block from that block alone. So, as for bitsandbytes (distributed/tensors/blockwise.py), a rank that steps its rows
computes, bit for bit, what vanilla's step of the whole tensor computes there, when every rank's rows start on
a block. Two things torchao would get wrong on a rotated parameter, which hf_rtp does instead:
- torchao decides between 8-bit and unquantized state by the size of the tensor it is handed (8-bit from 4096
  elements that divide into blocks): on a rank's rows, as under FSDP2, a short chunk of a large tensor would
  get unquantized state where vanilla's whole tensor gets 8-bit. hf_rtp decides by the whole tensor, and keeps
  unquantized state (as torchao does for small tensors) only where the rows cannot align, with a warning;
- torch.compile does not trace rotated tensors, so the step runs on each rank's local tensors.

How: a step pre-hook runs the optimizer's own step (its class's, on a shallow copy that holds this rank's local
rows) for the rotated parameters, then hides their gradients from the step that follows, which steps every
other parameter as torchao does; a post-hook gives the gradients back. Between steps a rotated parameter's state
is plain tensors that hf_rtp's training state saves and reshards: the uint8 codes (rotated like the parameter)
and their block scales under `<moment>_scale` (rotated, blockwise.py's world-size-free shape); the code maps are
torchao's constants. torchao's 4-bit and FP8 states, and its other optimizers, are refused by name.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import log
from ..distributed.tensors.blockwise import aligned
from ..distributed.tensors.rotated import RotatedTensor, rotated_scales
from ..errors import RotatedStateError
from ..private import torchao_names
from ..private.torch_names import clear_step_hooks, local_tensor

STEPPED = ("AdamW8bit", "Adam8bit")
QUANTIZED_FROM = 4096  # torchao's _AdamBase._new_buffer: 8-bit state from this many elements (as bitsandbytes)
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}  # torchao's moments and their code maps

_REFUSED = (
    "torchao's {name} over a rotated model: hf_rtp steps torchao's AdamW8bit and Adam8bit on each rank's rows, "
    "but not {why}. Use torchao.optim.AdamW8bit, bitsandbytes' AdamW8bit (Trainer: optim='adamw_bnb_8bit'), or "
    "torch.optim.AdamW"
)
_UNALIGNED = (
    "torchao keeps 8-bit optimizer state in blocks of {block} elements of the flattened tensor, and at {world} ranks "
    "the rows of {count} rotated parameter(s) (shapes {shapes}) do not start on such a block on every rank: hf_rtp "
    "keeps their state unquantized (in the parameter's dtype, as torchao keeps a small tensor's), so their steps "
    "differ slightly from vanilla's 8-bit ones. Rows whose width is a multiple of {block} always align"
)
_CAST = (
    "the 8-bit {key} codes of a rotated parameter of torchao's {name} are {dtype}: its state was loaded with "
    "optimizer.load_state_dict, which casts every state tensor to its parameter's dtype. Load the training state "
    "with hf_rtp.load_training_state (Trainer's resume_from_checkpoint does), which keeps it as saved"
)
_HOOKS: list = []
_HIDDEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> [(parameter, its gradient)]


def step_on_rows() -> None:
    """Once per process, on the first rotated load: the step pre- and post-hooks above. Both return at once for
    any optimizer that is not torchao's or holds no rotated parameter with a gradient (DESIGN.md, "Patches")."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def _before_step(optimizer, args, kwargs) -> None:
    if not type(optimizer).__module__.startswith("torchao."):
        return
    _HIDDEN.pop(optimizer, None)  # a step that raised after the hiding: its gradients are not given back
    rotated = [
        (group, p)
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, RotatedTensor) and p.grad is not None
    ]
    if not rotated:
        return
    _check_supported(optimizer)
    # torch hands the hooks step's own arguments, the optimizer first; a closure would recompute the gradients
    if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
        raise RotatedStateError(
            _REFUSED.format(name=type(optimizer).__name__, why="step(closure): call step() after your backward")
        )
    unaligned = [p for group, p in rotated if not optimizer.state.get(p) and not _init_rows(optimizer, group, p)]
    if unaligned:
        shapes = ", ".join(str(tuple(p.shape)) for p in unaligned[:5]) + (", ..." if len(unaligned) > 5 else "")
        log.warning(
            _UNALIGNED.format(block=torchao_names.scale_block(optimizer), world=unaligned[0].device_mesh.size(),
                              count=len(unaligned), shapes=shapes)
        )  # fmt: skip
    _step_rows(optimizer, rotated)
    _HIDDEN[optimizer] = [(p, p.grad) for _, p in rotated]
    for _, p in rotated:  # stepped: the step that follows must not step them again
        p.grad = None


def _after_step(optimizer, args, kwargs) -> None:
    for p, grad in _HIDDEN.pop(optimizer, ()):
        p.grad = grad


def _check_supported(optimizer) -> None:
    name = type(optimizer).__name__
    stepped = torchao_names.stepped_classes(STEPPED)
    if stepped is None or not isinstance(optimizer, stepped):
        raise RotatedStateError(_REFUSED.format(name=name, why=f"{name} (4-bit or FP8 state, or another class)"))
    if torchao_names.stochastic_rounding(optimizer):
        raise RotatedStateError(
            _REFUSED.format(
                name=name,
                why="with bf16_stochastic_round=True: its random rounding would draw for each rank's rows, not as "
                "vanilla draws for the whole tensor (pass bf16_stochastic_round=False)",
            )
        )


def _init_rows(optimizer, group: dict, p: DTensor) -> bool:
    """A rotated parameter's first state, decided by the whole tensor as vanilla torchao decides it; False where
    it would be 8-bit but the rows do not align, and is unquantized instead."""
    block, whole = torchao_names.scale_block(optimizer), p.numel()  # a DTensor's numel is the whole tensor's
    quantized = whole >= QUANTIZED_FROM and whole % block == 0
    rows = quantized and aligned(p.shape, p.device_mesh.size(), block)
    state = optimizer.state[p]
    state["step"] = torch.tensor(0.0)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq"):
        if rows:
            state[key] = torch.zeros_like(p, dtype=torch.uint8)
            state[f"{key}_scale"] = rotated_scales(p, block)
        else:
            state[key] = torch.zeros_like(p)
    return rows or not quantized


def _step_rows(optimizer, rotated: list) -> None:
    """The optimizer's own step, on a shallow copy holding this rank's rows as plain tensors and their state as
    torchao's 8-bit tensors over hf_rtp's codes and scales (updated in place)."""
    shadow = object.__new__(type(optimizer))  # not copy.copy: Optimizer.__getstate__ keeps only its own fields
    shadow.__dict__.update(optimizer.__dict__)
    clear_step_hooks(shadow)
    shadow.state, shadow.param_groups = {}, []
    maps: dict = {}
    block = torchao_names.scale_block(optimizer)
    for group in optimizer.param_groups:
        rows = []
        for p in (p for g, p in rotated if g is group):
            state = optimizer.state[p]
            if local_tensor(p).numel() == 0:  # no rows here: only the step count moves, as on the other ranks
                state["step"] += 1
                continue
            view = local_tensor(p).detach()
            view.grad = local_tensor(p.grad)
            working = {"step": state["step"]}
            for key, signed in SIGNED.items():
                if key not in state:
                    continue
                codes = local_tensor(state[key])
                if f"{key}_scale" not in state:
                    working[key] = codes
                    continue
                if codes.dtype != torch.uint8:  # torch's Optimizer.load_state_dict casts state to the weights' dtype
                    raise RotatedStateError(_CAST.format(name=type(optimizer).__name__, key=key, dtype=codes.dtype))
                if signed not in maps:  # as OptimState8bit.zeros makes them
                    values = torchao_names.code_map(signed)
                    maps[signed] = torch.tensor(values, dtype=torch.float32, device=codes.device)
                scale = local_tensor(state[f"{key}_scale"]).view(-1)[: codes.numel() // block]
                working[key] = torchao_names.state_8bit(codes, scale, maps[signed], signed, dtype=p.dtype)
            shadow.state[view] = working
            rows.append(view)
        shadow.param_groups.append({**group, "params": rows})
    step = type(optimizer).step
    with torch.no_grad():  # the class's step without the hooks around it: they ran once, for this step
        getattr(step, "__wrapped__", step)(shadow)
