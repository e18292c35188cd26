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

import dataclasses
import functools
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import log
from ..checkpoint.conversion import Source
from ..checkpoint.safetensors_io import read_rows
from ..distributed.blockwise import BLOCK, aligned
from ..distributed.rotated import RotatedTensor, rotated_scales, whole
from ..distributed.sharding import chunk_rows
from ..errors import CheckpointError, RotatedStateError
from ..layers.linear import RotatedLinear
from ..layers.linear4bit import Quant4bit, RotatedLinear4bit, packed_columns, piece_of, quantize_double, quantize_rows
from ..layers.linear8bit import SCALE_BYTES, Quant8bit, RotatedLinear8bit, quantize_rows8
from ..private.transformers_names import keep_in_fp32_modules

BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which transformers' Linear4bit uses
SUPPORTED = (
    "hf_rtp rotates bitsandbytes only: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4' or "
    "'fp4', bnb_4bit_compute_dtype=..., bnb_4bit_use_double_quant=True or False) or BitsAndBytesConfig("
    "load_in_8bit=True, llm_int8_threshold=..., llm_int8_skip_modules=...)"
)


def checked_config(quantization_config: Any):
    """The BitsAndBytesConfig to load with, or TypeError naming what was passed and what is supported."""
    from transformers import BitsAndBytesConfig

    if isinstance(quantization_config, dict):
        named = str(quantization_config.get("quant_method", "bitsandbytes"))
        if named != "bitsandbytes":
            raise TypeError(f"hf_rtp.from_pretrained does not take quantization_config with quant_method={named!r}: "
                            f"{SUPPORTED}")  # fmt: skip
        quantization_config = BitsAndBytesConfig.from_dict(quantization_config)
    if not isinstance(quantization_config, BitsAndBytesConfig):
        method = getattr(quantization_config, "quant_method", None)
        raise TypeError(
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
            raise TypeError(
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
        raise TypeError(
            "hf_rtp.from_pretrained does not take quantization_config on a ring of one rank (one process, or "
            "rtp_size=1): nothing rotates there. Load it with transformers' from_pretrained"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"bitsandbytes quantizes float32, bfloat16 or float16 weights, not dtype={dtype}")
    kept = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules, keep_in_fp32_modules(model))
    spec: Quant4bit | Quant8bit = (
        Quant8bit(config.llm_int8_threshold)
        if config.load_in_8bit
        else Quant4bit(config.bnb_4bit_quant_type, BLOCKSIZE, dtype, config.bnb_4bit_compute_dtype)
    )
    chosen: dict[str, Quant4bit | Quant8bit] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, module in model.named_modules():
        if not (type(module) is nn.Linear or isinstance(module, Conv1D)) or not should_convert_module(name, kept):
            continue
        if module is head:  # transformers skips it by default, but not once llm_int8_skip_modules is given
            raise TypeError(
                f"quantization_config: llm_int8_skip_modules={config.llm_int8_skip_modules} leaves the LM head "
                f"({name}) to be quantized, which hf_rtp does not do (its loss runs on the rotated head): add "
                f"{name!r} to llm_int8_skip_modules"
            )
        if resolution.rotated.get(name) != "linear":
            raise TypeError(
                f"quantization_config: transformers would quantize {name} ({type(module).__name__}), which this "
                f"plan does not rotate as a linear layer; hf_rtp quantizes rotated nn.Linear modules only. "
                f"Add it to llm_int8_skip_modules to keep it unquantized, as vanilla would then"
            )
        if isinstance(spec, Quant4bit) and module.in_features % BLOCKSIZE:
            raise TypeError(
                f"quantization_config: {name} has in_features={module.in_features}, not a multiple of bitsandbytes' "
                f"block size {BLOCKSIZE}, so its rows cannot be quantized apart exactly as the whole weight is. "
                "Add it to llm_int8_skip_modules"
            )
        chosen[name] = spec
        if module.bias is not None:
            resolution.rotated_params.discard(f"{name}.bias")
            resolution.replicated.append(f"{name}.bias")
    return chosen


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


def swap_modules(model: Any, chosen: dict[str, Quant4bit | Quant8bit], config) -> None:
    """After install: each chosen rotated linear becomes its 4-bit (8-bit) kind; the model says it is loaded in 4
    (8) bits, as vanilla's does (PEFT's prepare_model_for_kbit_training reads it)."""
    for name, spec in chosen.items():
        source = cast(RotatedLinear, model.get_submodule(name))
        kind = (
            RotatedLinear8bit(source, spec=spec)
            if isinstance(spec, Quant8bit)
            else RotatedLinear4bit(source, spec=spec)
        )
        model.set_submodule(name, kind)
    if config.load_in_8bit:
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    model.config.quantization_config = config


# checkpoints saved quantized by vanilla (save_pretrained of a 4-bit or 8-bit model): each rank reads its rows'
# packed bytes (int8 codes) and scales, never the whole tensor

_QUANT_STATE = re.compile(r"\.weight\.quant_state\.bitsandbytes__(nf4|fp4)$")


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
    except TypeError as err:
        raise CheckpointError(f"this checkpoint was saved quantized by bitsandbytes with a setting hf_rtp does not "
                              f"read: {err}") from None  # fmt: skip


def stored_specs(chosen: dict[str, Quant4bit | Quant8bit], config, entries: dict) -> dict[str, Quant4bit | Quant8bit]:
    """`chosen` (the modules transformers would quantize) for a checkpoint saved quantized: each must be stored
    quantized, and nothing else; a 4-bit one with the spec its stored quant_state gives (quant type, block size,
    the dtype it was quantized from, which dequantizing returns)."""
    if config.load_in_8bit:
        stored = {key.removesuffix(".SCB") for key in entries if key.endswith(".SCB")}
        if stored != set(chosen):
            _mismatch(chosen, stored)
        return chosen
    specs: dict[str, Quant4bit | Quant8bit] = {}
    for key in entries:
        found = _QUANT_STATE.search(key)
        if found is None:
            continue
        name = key[: found.start()]
        state = _quant_state(entries[key])
        if state.get("quant_type") != found.group(1) or found.group(1) != config.bnb_4bit_quant_type:
            raise CheckpointError(
                f"{key} says quant_type={state.get('quant_type')!r}, but the checkpoint's config says "
                f"bnb_4bit_quant_type={config.bnb_4bit_quant_type!r}: it is damaged"
            )
        stored_dtype = getattr(torch, str(state.get("dtype")), None)
        if not isinstance(stored_dtype, torch.dtype) or state.get("blocksize") != BLOCKSIZE:
            raise CheckpointError(f"{key}: hf_rtp reads 4-bit weights of blocksize {BLOCKSIZE} quantized from a float "
                                  f"dtype, not {state}")  # fmt: skip
        specs[name] = Quant4bit(config.bnb_4bit_quant_type, BLOCKSIZE, stored_dtype, config.bnb_4bit_compute_dtype)
    if set(specs) != set(chosen):
        _mismatch(chosen, set(specs))
    return specs


def _mismatch(chosen: dict, stored: set[str]) -> None:
    raise CheckpointError(
        "the checkpoint's quantized modules are not the ones transformers quantizes under its quantization_config: "
        f"stored quantized but not chosen: {sorted(stored - set(chosen))[:5]}; chosen but stored unquantized: "
        f"{sorted(set(chosen) - stored)[:5]}. It was saved by other code or with other llm_int8_skip_modules"
    )


def _quant_state(entry) -> dict:
    try:
        state = json.loads(bytes(read_rows(entry).tolist()).decode())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{entry.name} in {entry.path} is not bitsandbytes' quant state JSON ({err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{entry.name} in {entry.path} is not bitsandbytes' quant state JSON")
    return state


@dataclass(frozen=True)
class _StoredPiece(Source):
    """The stored tensors of one quantized weight and how this rank's piece is read from them (rows of each)."""

    stored: tuple[str, ...] = ()
    reader: Callable[[dict, tuple[int, int]], torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.stored)

    def read(self, entries: dict, rows: tuple[int, int] | None) -> torch.Tensor:
        assert self.reader is not None and rows is not None
        return self.reader(entries, rows)


def read_stored(chosen: dict[str, Quant4bit | Quant8bit], model: Any, wants: dict, entries: dict) -> None:
    """Point each chosen weight's read at the checkpoint's quantized tensors: the piece layers/linear4bit.py
    (linear8bit.py) computes with, from this rank's rows of the packed bytes (codes) and their scales."""
    for name, spec in chosen.items():
        module, key = model.get_submodule(name), f"{name}.weight"
        if isinstance(spec, Quant8bit):
            stored = [key, f"{name}.SCB"] + ([f"{key}_format"] if f"{key}_format" in entries else [])
            reader = functools.partial(
                _rows8, key=key, scales=f"{name}.SCB", shape=(module.out_features, module.in_features)
            )
        else:
            state_key = next(k for k in entries if k.startswith(f"{key}.quant_state."))
            nested = f"{key}.nested_absmax" in entries
            stored = [key, f"{key}.absmax", f"{key}.quant_map", state_key]
            stored += [f"{key}.nested_absmax", f"{key}.nested_quant_map"] if nested else []
            reader = functools.partial(_rows4, key=key, state=state_key, nested=nested, spec=spec,
                                       shape=(module.out_features, module.in_features))  # fmt: skip
        missing = [n for n in stored if n not in entries]
        if missing:
            raise CheckpointError(f"the quantized checkpoint lacks {', '.join(missing)}, which {name} needs")
        wants[key] = dataclasses.replace(wants[key], source=_StoredPiece([], stored=tuple(stored), reader=reader))


def _checked(entry, dtype: torch.dtype, shape: tuple[int, ...]):
    if entry.dtype != dtype or tuple(entry.shape) != tuple(shape):
        raise CheckpointError(
            f"{entry.name} in {entry.path} is {entry.dtype} {list(entry.shape)}, but this model's config makes it "
            f"{dtype} {list(shape)}: the weights and the config belong to different models"
        )
    return entry


def _rows8(entries: dict, rows: tuple[int, int], key: str, scales: str, shape: tuple[int, int]) -> torch.Tensor:
    start, end = rows
    codes = read_rows(_checked(entries[key], torch.int8, shape), start, end)
    row_scales = read_rows(_checked(entries[scales], torch.float32, shape[:1]), start, end)
    return torch.cat([codes.view(torch.uint8), row_scales.view(torch.uint8).view(-1, SCALE_BYTES)], dim=1)


def _rows4(entries: dict, rows: tuple[int, int], key: str, state: str, nested: bool, spec: Quant4bit,
           shape: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    (start, end), (out, inp) = rows, shape
    per_row, blocks = inp // 2, inp // spec.blocksize
    stored_state = _quant_state(entries[state])
    if list(stored_state.get("shape", [])) != [out, inp]:
        raise CheckpointError(f"{state} records shape {stored_state.get('shape')}, but this model's config makes "
                              f"{key} {[out, inp]}: the weights and the config belong to different models")  # fmt: skip
    packed = read_rows(_checked(entries[key], torch.uint8, (out * per_row, 1)), start * per_row, end * per_row)
    quant_map = read_rows(_checked(entries[f"{key}.quant_map"], torch.float32, (16,)))
    if not torch.equal(quant_map, _code_book(spec.quant_type)):
        raise CheckpointError(f"{key}.quant_map is not bitsandbytes' {spec.quant_type} code book: hf_rtp computes "
                              "with bitsandbytes' own, so it cannot read this checkpoint")  # fmt: skip
    first, last = start * blocks, end * blocks
    if not nested:
        absmax = read_rows(_checked(entries[f"{key}.absmax"], torch.float32, (out * blocks,)), first, last)
    else:  # double quantization: 8-bit codes of absmax - offset, with one float32 scale per 256 of them
        codes = read_rows(_checked(entries[f"{key}.absmax"], torch.uint8, (out * blocks,)), first, last)
        outer = -(-out * blocks // 256)
        scales = read_rows(_checked(entries[f"{key}.nested_absmax"], torch.float32, (outer,)))
        code = read_rows(_checked(entries[f"{key}.nested_quant_map"], torch.float32, (256,)))
        which = torch.arange(first, last) // 256
        absmax = code[codes.long()] * scales[which]  # bitsandbytes' dequantize_blockwise, element by element
        absmax += torch.tensor(float(stored_state["nested_offset"]), dtype=torch.float32)
    return piece_of(packed.view(end - start, per_row), absmax.view(end - start, blocks))


def _code_book(quant_type: str) -> torch.Tensor:
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.get_4bit_type(quant_type, device="cpu").float()


# bitsandbytes' optimizers on rotated rows (distributed/blockwise.py runs their update ops on each rank's rows)

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
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    if module is None or not isinstance(optimizer, module.Optimizer8bit):
        return
    fresh = [
        (gindex, pindex, group, p)
        for gindex, group in enumerate(optimizer.param_groups)
        for pindex, p in enumerate(group["params"])
        if isinstance(p, RotatedTensor) and p.grad is not None and not optimizer.state.get(p)
    ]
    if not fresh:
        return
    if not optimizer.initialized:
        optimizer.check_overrides()  # bitsandbytes' first step does it before init_state: module overrides
    for gindex, pindex, group, _ in fresh:  # before any state exists or any row has stepped
        if optimizer.get_config(gindex, pindex, group)["max_unorm"] > 0.0:
            raise RotatedStateError(
                f"{type(optimizer).__name__} bounds each update by the whole parameter's norm (max_unorm, as LAMB "
                "and LARS do), which no rank can compute from its rows alone. Use bitsandbytes' AdamW8bit, Adam8bit, "
                "Lion8bit (or their 32-bit and paged forms), or torch.optim.AdamW, with a rotated model"
            )
    paged, optimizer.is_paged = optimizer.is_paged, optimizer.is_paged and fresh[0][3].device.type == "cpu"
    if paged and not optimizer.is_paged:  # its paged buffers take the whole shape; on CPU it does not page
        log.warning(_PAGED)
    try:
        unaligned = [p for gindex, pindex, group, p in fresh if not _init_rows(optimizer, group, p, gindex, pindex)]
    finally:
        optimizer.is_paged = paged
    if unaligned:
        shapes = ", ".join(str(tuple(p.shape)) for p in unaligned[:5]) + (", ..." if len(unaligned) > 5 else "")
        world = unaligned[0].device_mesh.size()
        log.warning(_UNALIGNED.format(block=BLOCK, world=world, count=len(unaligned), shapes=shapes))


def _init_rows(optimizer, group: dict, p: DTensor, gindex: int, pindex: int) -> bool:
    """bitsandbytes' own init (8-bit or not by the global size), its block scales made this rank's; False when
    the rows do not align and the state became float32 instead."""
    optimizer.init_state(group, p, gindex, pindex)
    state = optimizer.state[p]
    if state["state1"].dtype != torch.uint8:
        return True
    if aligned(p.shape, p.device_mesh.size()):
        for key in ("absmax1", "absmax2"):
            if key in state:
                state[key] = rotated_scales(p)
        return True
    for key in ("state1", "state2"):
        if key in state:
            state[key] = torch.zeros_like(p, dtype=torch.float32)
    for key in ("qmap1", "qmap2", "absmax1", "absmax2"):
        state.pop(key, None)
    return False
