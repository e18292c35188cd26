"""bitsandbytes: `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` (QLoRA) or `load_in_8bit=True`
(LLM.int8()), a frozen quantized base that rotates, with the modules transformers would quantize and the numbers
its Linear4bit / Linear8bitLt compute; and its optimizers' state on rotated rows (below).

transformers decides which modules become bitsandbytes' Linear4bit or Linear8bitLt (every exact nn.Linear or
Conv1D but those its quantizer keeps: the output embeddings, tied weights, `llm_int8_skip_modules`, a class's
float32 modules); hf_rtp asks it the same question (`HfQuantizer.get_modules_to_not_convert`,
`should_convert_module`). Each such module must be a rotated linear here, and for 4 bits its `in_features` a
multiple of the block size, so that every rank's rows quantize exactly as the whole tensor does
(layers/linear4bit.py; 8 bits quantize each row alone, layers/linear8bit.py); anything else is refused by name
before a byte is read. Each rank reads its rows in the load dtype and quantizes them as they are read, so no
rank ever holds a whole weight, or all of its own rows unquantized.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import log
from ..checkpoint import quantized as quantized_checkpoint
from ..checkpoint.quantized import NOT_QUANTIZED, QuantizedLoad
from ..distributed.tensors.blockwise import BLOCK, aligned
from ..distributed.tensors.rotated import RotatedTensor, rotated_scales, whole
from ..distributed.tensors.sharding import chunk_rows
from ..errors import CheckpointError, KeywordError, RotatedStateError
from ..layers import siblings
from ..layers.linear import RotatedLinear
from ..layers.linear4bit import (
    BLOCKSIZE,
    Quant4bit,
    RotatedLinear4bit,
    packed_columns,
    piece_of,
    quantize_double,
    quantize_rows,
)
from ..layers.linear8bit import SCALE_BYTES, Quant8bit, RotatedLinear8bit, quantize_rows8
from ..private import bitsandbytes_names
from ..private.transformers_names import keep_in_fp32_modules

SUPPORTED = (
    "hf_rtp rotates bitsandbytes only: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4' or "
    "'fp4', bnb_4bit_compute_dtype=..., bnb_4bit_use_double_quant=True or False) or BitsAndBytesConfig("
    "load_in_8bit=True, llm_int8_threshold=..., llm_int8_skip_modules=...)"
)


def checked_config(quantization_config: Any):
    """The BitsAndBytesConfig to load with, or TypeError naming what was passed and what is supported."""
    from transformers import BitsAndBytesConfig

    if isinstance(quantization_config, dict):
        named = quantization_config.get("quant_method", "bitsandbytes")
        named = str(getattr(named, "value", named))  # BitsAndBytesConfig.to_dict() keeps the QuantizationMethod enum
        if named != "bitsandbytes":
            raise KeywordError(f"hf_rtp.from_pretrained does not take quantization_config with quant_method={named!r}: "
                            f"{SUPPORTED}")  # fmt: skip
        quantization_config = BitsAndBytesConfig.from_dict(quantization_config)
    if not isinstance(quantization_config, BitsAndBytesConfig):
        method = getattr(quantization_config, "quant_method", None)
        raise KeywordError(
            f"hf_rtp.from_pretrained does not take quantization_config={type(quantization_config).__name__} "
            f"(quant_method={str(getattr(method, 'value', method))!r}): {SUPPORTED}. It never loads such a model "
            "whole or dequantized"
        )
    refused = {
        "neither load_in_4bit nor load_in_8bit": not (
            quantization_config.load_in_4bit or quantization_config.load_in_8bit
        ),
        "llm_int8_has_fp16_weight=True (trainable 8-bit weights)": (
            quantization_config.load_in_8bit and quantization_config.llm_int8_has_fp16_weight
        ),
        f"bnb_4bit_quant_storage={quantization_config.bnb_4bit_quant_storage}": (
            quantization_config.bnb_4bit_quant_storage != torch.uint8
        ),
        "llm_int8_enable_fp32_cpu_offload=True": quantization_config.llm_int8_enable_fp32_cpu_offload,
    }  # fmt: skip
    for setting, present in refused.items():
        if present:
            raise KeywordError(
                f"hf_rtp.from_pretrained does not take a BitsAndBytesConfig with {setting}: {SUPPORTED} "
                "(a frozen base whose quantized bytes hf_rtp stores as uint8 and shards by rows itself)"
            )
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    except ImportError as err:
        raise ImportError(f"quantization_config needs bitsandbytes: pip install bitsandbytes ({err})") from err
    return quantization_config


def select(model: Any, resolution, config, dtype: torch.dtype, rtp_size: int) -> dict[str, Quant4bit | Quant8bit]:
    """The modules transformers would make Linear4bit (Linear8bitLt), each with what computing it needs; the biases
    of those modules become replicated parameters in `resolution` (read whole, as vanilla holds them)."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    if rtp_size < 2:
        raise KeywordError(
            "hf_rtp.from_pretrained does not take quantization_config on a ring of one rank (one process, or "
            "rtp_size=1): nothing rotates there. Load it with transformers' from_pretrained"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KeywordError(f"bitsandbytes quantizes float32, bfloat16 or float16 weights, not dtype={dtype}")
    kept = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules, keep_in_fp32_modules(model))
    spec: Quant4bit | Quant8bit = (
        Quant8bit(config.llm_int8_threshold)
        if config.load_in_8bit
        else Quant4bit(config.bnb_4bit_quant_type, BLOCKSIZE, dtype, config.bnb_4bit_compute_dtype)
    )
    chosen: dict[str, Quant4bit | Quant8bit] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in list(model.named_modules()):
        if not (type(module) is nn.Linear or isinstance(module, Conv1D)) or not should_convert_module(name, kept):
            continue
        if module is head:  # transformers skips it by default, but not once llm_int8_skip_modules is given
            raise KeywordError(
                f"quantization_config: llm_int8_skip_modules={config.llm_int8_skip_modules} leaves the LM head "
                f"({name}) to be quantized, which hf_rtp does not do (its loss runs on the rotated head): add "
                f"{name!r} to llm_int8_skip_modules"
            )
        if isinstance(module, Conv1D) and resolution.rotated.get(name) == "conv1d":
            module = _linear_for(model, name, module, resolution)
        if resolution.rotated.get(name) != "linear":
            raise KeywordError(
                f"quantization_config: transformers would quantize {name} ({type(module).__name__}), which this "
                f"plan does not rotate as a linear layer; hf_rtp quantizes rotated nn.Linear modules only. "
                f"Add it to llm_int8_skip_modules to keep it unquantized, as vanilla would then"
            )
        if isinstance(spec, Quant4bit) and module.in_features % BLOCKSIZE:
            raise KeywordError(
                f"quantization_config: {name} has in_features={module.in_features}, not a multiple of bitsandbytes' "
                f"block size {BLOCKSIZE}, so its rows cannot be quantized apart exactly as the whole weight is. "
                "Add it to llm_int8_skip_modules"
            )
        chosen[name] = spec
        if module.bias is not None and f"{name}.bias" not in resolution.replicated:
            resolution.rotated_params.discard(f"{name}.bias")
            resolution.replicated.append(f"{name}.bias")
    return chosen


def _linear_for(model: Any, name: str, conv: Any, resolution) -> nn.Linear:
    """What vanilla's bitsandbytes makes of a GPT-2 Conv1D: a linear of its transposed weight (Linear4bit(nx, nf),
    the stored [in, out] weight quantized as [out, in]), so it rotates by output rows like any quantized linear;
    its weight is read transposed (checkpoint/conversion.py's Transposed), its bias is the linear's."""
    with torch.device("meta"):
        linear = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None, dtype=conv.weight.dtype)
    model.set_submodule(name, linear)
    resolution.rotated[name] = "linear"
    resolution.transposed.add(f"{name}.weight")  # its bias stays replicated, as every quantized linear's (select)
    return linear


def quantizers(chosen: dict[str, Quant4bit | Quant8bit]) -> dict:
    """Parameter name -> what turns its rows, as read, into this rank's piece (before double quantization)."""
    return {f"{name}.weight": functools.partial(_quantized_piece, spec=spec) for name, spec in chosen.items()}


def _quantized_piece(rows: torch.Tensor, spec: Quant4bit | Quant8bit) -> torch.Tensor:
    if isinstance(spec, Quant8bit):
        return quantize_rows8(rows)
    return piece_of(*quantize_rows(rows, spec))


def finish(
    model: Any, chosen: dict[str, Quant4bit | Quant8bit], tensors: dict, config, topology, stored: bool = False
) -> None:
    """Collective, after the read: double quantization (its offset is the whole tensor's mean, so the ranks
    gather each weight's absmax, about 3% of its bf16 bytes, one tensor at a time; a checkpoint saved quantized,
    `stored`, holds that offset already), then the meta weights reshaped to the pieces' [out_features, bytes per
    row] so that install makes them rotated parameters."""
    for name in sorted(chosen):
        module, spec = model.get_submodule(name), chosen[name]
        columns = module.in_features // 2
        if isinstance(spec, Quant4bit) and config.bnb_4bit_use_double_quant and not stored:
            piece = tensors[f"{name}.weight"]
            absmax = piece[:, columns:].contiguous().view(torch.float32)
            shape = torch.Size((module.out_features, absmax.shape[1]))
            gathered = DTensor.from_local(absmax, topology.mesh, [Shard(0)], run_check=False, shape=shape,
                                          stride=torch.empty(shape, device="meta").stride())  # fmt: skip
            start, end = chunk_rows(module.out_features, topology.rtp_size, topology.rtp_rank)
            restored = quantize_double(whole(gathered))[start:end]
            tensors[f"{name}.weight"] = piece_of(piece[:, :columns], restored)
        width = (
            packed_columns(module.in_features, spec)
            if isinstance(spec, Quant4bit)
            else module.in_features + SCALE_BYTES
        )
        module.weight = nn.Parameter(
            torch.empty(module.out_features, width, dtype=torch.uint8, device="meta"), requires_grad=False
        )


def swap_modules(model: Any, chosen: dict[str, Quant4bit | Quant8bit], config, stored: bool = False) -> None:
    """After install: each chosen rotated linear becomes its 4-bit (8-bit) kind; the model says it is loaded in 4
    (8) bits and quantized, as vanilla's does: PEFT's prepare_model_for_kbit_training and TRL read
    `is_loaded_in_4bit`, Trainer refuses to train a quantized base without adapters by `is_quantized` and
    `hf_quantizer` (transformers' own quantizer object for this config, as vanilla holds it).

    `quantization_method` is left unset: Trainer would then not move the model to its device in __init__,
    which is where hf_rtp attaches to it (integrations/trainer.py); vanilla skips that move because bitsandbytes'
    parameters cannot move, hf_rtp's rows can. `model.dequantize()` is refused by name (binding.bind)."""
    from transformers.quantizers import AutoHfQuantizer

    for name, spec in chosen.items():
        source = cast(RotatedLinear, model.get_submodule(name))
        kind = (
            RotatedLinear8bit(source, spec=spec)
            if isinstance(spec, Quant8bit)
            else RotatedLinear4bit(source, spec=spec)
        )
        model.set_submodule(name, kind)
    # the parents of swapped linears are grouped again: float with float, each quantized kind with its own
    # (layers/siblings.py: q/k/v's packed rows walk stacked, one skipped by llm_int8_skip_modules walks apart)
    for parent in {name.rpartition(".")[0] for name in chosen}:
        owner = model.get_submodule(parent)
        for child in owner.children():
            vars(child).pop("siblings", None)
        siblings.group(owner, (RotatedLinear, RotatedLinear4bit, RotatedLinear8bit))
    if config.load_in_8bit:
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    model.is_quantized = True
    model.hf_quantizer = AutoHfQuantizer.from_config(config, pre_quantized=stored)
    model.config.quantization_config = config


class BitsAndBytesLoad:
    """checkpoint.quantized.QuantizedLoad for a bitsandbytes 4-bit or 8-bit base: quantized as it is read, or read
    as vanilla saved it quantized (`stored`, checkpoint/quantized.py reads each rank's rows)."""

    def __init__(self, config, stored: bool):
        self.config, self.stored = config, stored
        self.chosen: dict[str, Quant4bit | Quant8bit] = {}

    def plan(self, model: Any, resolution, dtype: torch.dtype, rtp_size: int) -> None:
        self.chosen = select(model, resolution, self.config, dtype, rtp_size)

    def transforms(self, model: Any, wants: dict, entries: dict) -> dict | None:
        if not self.stored:
            return quantizers(self.chosen)
        self.chosen = quantized_checkpoint.stored_specs(self.chosen, self.config, entries)
        quantized_checkpoint.read_stored(self.chosen, model, wants, entries)
        return None

    def finish(self, model: Any, tensors: dict, topology) -> None:
        if self.chosen:
            finish(model, self.chosen, tensors, self.config, topology, stored=self.stored)

    def install(self, model: Any) -> None:
        if self.chosen:
            swap_modules(model, self.chosen, self.config, stored=self.stored)


def quantized_load(config, requested) -> QuantizedLoad:
    """This load's quantization: the checkpoint's own (saved quantized by bitsandbytes: read as stored; its config
    wins over `requested`, as transformers' merge_quantization_configs does), else `requested` (from_pretrained's
    quantization_config, already checked by keywords.py), else none. A checkpoint quantized by any other method is
    refused by name. Records the config on `config` as vanilla does (it is in the ranks' fingerprint)."""
    stored = stored_config(config)
    if stored is None:
        _refuse_quantized(config)
    elif requested is not None:
        log.warning(  # vanilla's merge_quantization_configs: the checkpoint's own config wins
            "this checkpoint is already quantized by bitsandbytes: its own quantization_config is used, the one "
            "passed to from_pretrained is ignored (as transformers does)"
        )
    quantization = stored or requested
    if quantization is None:
        return NOT_QUANTIZED
    config.quantization_config = quantization
    return BitsAndBytesLoad(quantization, stored=stored is not None)


def _refuse_quantized(config) -> None:
    """A checkpoint saved quantized (a `quantization_config` in its config.json: GPTQ, AWQ, FP8, bitsandbytes,
    ...) holds packed integers or scaled floats that mean nothing without the method's scales and kernels.
    Read as plain weights they would load without an error (an FP8 checkpoint did, its scales ignored): a
    silently different model. hf_rtp reads bitsandbytes' own 4-bit and 8-bit checkpoints as stored
    and refuses every other method by name."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    method = getattr(method, "value", method)  # transformers' QuantizationMethod, by its value
    raise CheckpointError(
        f"this checkpoint is quantized (its config has a quantization_config, quant_method={str(method)!r}): its "
        "weights need that method's scales and kernels, and hf_rtp reads only bitsandbytes' own 4-bit and 8-bit "
        "checkpoints, so it will not read them as plain weights. Load an unquantized (bfloat16 or float32) "
        "checkpoint of the model, with quantization_config=BitsAndBytesConfig(load_in_4bit=True) (or "
        "load_in_8bit=True) for a quantized base"
    )


# checkpoints saved quantized by vanilla (save_pretrained of a 4-bit or 8-bit model): read as stored
# (checkpoint/quantized.py reads each rank's rows)


def stored_config(config):
    """The BitsAndBytesConfig a checkpoint was saved quantized with (4-bit or 8-bit), or None when it was not saved
    by bitsandbytes; a bitsandbytes setting hf_rtp does not reproduce is a CheckpointError naming it."""
    quantization = getattr(config, "quantization_config", None)
    named = quantization.get("quant_method") if isinstance(quantization, dict) else None
    named = named or getattr(quantization, "quant_method", None)
    if quantization is None or str(getattr(named, "value", named)) != "bitsandbytes":
        return None
    try:
        return checked_config(quantization)
    except KeywordError as err:
        raise CheckpointError(f"this checkpoint was saved quantized by bitsandbytes with a setting hf_rtp does not "
                              f"read: {err}") from None  # fmt: skip


# bitsandbytes' optimizers on rotated rows (distributed/tensors/blockwise.py runs their update ops on each rank's rows)

_UNALIGNED = (
    "bitsandbytes keeps 8-bit optimizer state in blocks of {block} elements of the flattened tensor, and at {world} "
    "ranks the rows of {count} rotated parameter(s) (shapes {shapes}) do not start on such a block on every rank: "
    "hf_rtp keeps their state in float32 (as optim_bits=32 would), so their steps differ slightly from vanilla's "
    "8-bit ones. Rows whose width is a multiple of {block} (every real model's hidden size) always align"
)
_PAGED = "hf_rtp keeps a paged bitsandbytes optimizer's state of rotated rows in ordinary device memory, unpaged"
_HOOK: list = []


def step_on_rows() -> None:
    """Once per process, on the first rotated load: a step pre-hook that gives each rotated parameter of a
    bitsandbytes optimizer its state before bitsandbytes' own `init_state` would (which sizes the 8-bit block
    scales by the whole tensor): bitsandbytes' own init, then the scales as this rank's blocks
    (`rotated_scales`), or float32 state where the rows do not align. It returns at once for any optimizer that
    is not bitsandbytes' or holds no rotated parameter without state (DESIGN.md, "Patches")."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer, args, kwargs) -> None:
    if not bitsandbytes_names.is_optimizer(optimizer):
        return
    fresh = [
        (gindex, pindex, group, p)
        for gindex, group in enumerate(optimizer.param_groups)
        for pindex, p in enumerate(group["params"])
        if isinstance(p, RotatedTensor) and p.grad is not None and not optimizer.state.get(p)
    ]
    if not fresh:
        return
    bitsandbytes_names.apply_overrides(optimizer)  # as its first step does before init_state: module overrides
    for gindex, pindex, group, _ in fresh:  # before any state exists or any row has stepped
        if bitsandbytes_names.max_unorm(optimizer, gindex, pindex, group) > 0.0:
            raise RotatedStateError(
                f"{type(optimizer).__name__} bounds each update by the whole parameter's norm (max_unorm, as LAMB "
                "and LARS do), which no rank can compute from its rows alone. Use bitsandbytes' AdamW8bit, Adam8bit, "
                "Lion8bit (or their 32-bit and paged forms), or torch.optim.AdamW, with a rotated model"
            )
    paged = bitsandbytes_names.paged(optimizer)
    kept = paged and fresh[0][3].device.type == "cpu"
    bitsandbytes_names.set_paged(optimizer, kept)
    if paged and not kept:  # its paged buffers take the whole shape; on CPU it does not page
        log.warning(_PAGED)
    try:
        unaligned = [p for gindex, pindex, group, p in fresh if not _init_rows(optimizer, group, p, gindex, pindex)]
    except RotatedStateError:
        for _, _, _, p in fresh:  # refused before any row stepped: no state left behind, as LAMB's refusal leaves
            optimizer.state.pop(p, None)
        raise
    finally:
        bitsandbytes_names.set_paged(optimizer, paged)
    if unaligned:
        shapes = ", ".join(str(tuple(p.shape)) for p in unaligned[:5]) + (", ..." if len(unaligned) > 5 else "")
        world = unaligned[0].device_mesh.size()
        log.warning(_UNALIGNED.format(block=BLOCK, world=world, count=len(unaligned), shapes=shapes))


def _refuse_whole_state(optimizer, p: DTensor) -> None:
    """A state tensor bitsandbytes' init sized by the whole parameter rather than like it (AdEMAMix's two EMAs in one
    (2, *shape) tensor): its update op would meet this rank's rows with the whole tensor's state."""
    small = bitsandbytes_names.SCALES + bitsandbytes_names.CODE_MAPS  # per block and per code: made this rank's above
    for key, value in optimizer.state[p].items():
        if key in small or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if value.numel() >= p.numel():
            raise RotatedStateError(
                f"bitsandbytes' {type(optimizer).__name__} keeps its state {key!r} for the whole parameter "
                f"({tuple(value.shape)} for {tuple(p.shape)}), not like the parameter, so it cannot step each rank's "
                "rows. Use bitsandbytes' AdamW8bit, Adam8bit, Lion8bit (or their 32-bit and paged forms), or "
                "torch.optim.AdamW, with a rotated model"
            )


def _init_rows(optimizer, group: dict, p: DTensor, gindex: int, pindex: int) -> bool:
    """bitsandbytes' own init (8-bit or not by the global size), its block scales made this rank's; False when
    the rows do not align and the state became float32 instead."""
    bitsandbytes_names.first_state(optimizer, group, p, gindex, pindex)
    _refuse_whole_state(optimizer, p)  # as bitsandbytes made it, before any of it is made this rank's below
    state = optimizer.state[p]
    if state[bitsandbytes_names.MOMENTS[0]].dtype != torch.uint8:
        return True
    if aligned(p.shape, p.device_mesh.size()):
        for key in bitsandbytes_names.SCALES:
            if key in state:
                state[key] = rotated_scales(p)
        return True
    for key in bitsandbytes_names.MOMENTS:
        if key in state:
            state[key] = torch.zeros_like(p, dtype=torch.float32)
    for key in bitsandbytes_names.CODE_MAPS + bitsandbytes_names.SCALES:
        state.pop(key, None)
    return False
