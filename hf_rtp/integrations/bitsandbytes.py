"""bitsandbytes: `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)`, a frozen 4-bit base that
rotates (QLoRA), with the modules transformers would quantize and the numbers its Linear4bit computes.

transformers decides which modules become bitsandbytes' Linear4bit (every exact nn.Linear or Conv1D but
those its quantizer keeps: the output embeddings, tied weights, `llm_int8_skip_modules`, a class's
float32 modules); hf_rtp asks it the same question (`HfQuantizer.get_modules_to_not_convert`,
`should_convert_module`). Each such module must be a rotated linear here, and its `in_features` a
multiple of the block size, so that every rank's rows quantize exactly as the whole tensor does
(layers/linear4bit.py); anything else is refused by name before a byte is read. Each rank reads its rows
in the load dtype and quantizes them as they are read, so no rank ever holds a whole weight, or all of
its own rows unquantized.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..distributed.rotated import whole
from ..distributed.sharding import chunk_rows
from ..layers.linear import RotatedLinear
from ..layers.linear4bit import Quant4bit, RotatedLinear4bit, packed_columns, piece_of, quantize_double, quantize_rows
from ..private.transformers_names import keep_in_fp32_modules

BLOCKSIZE = 64  # bitsandbytes' Params4bit default, which transformers' Linear4bit uses
SUPPORTED = (
    "hf_rtp rotates bitsandbytes 4-bit only: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4' or "
    "'fp4', bnb_4bit_compute_dtype=..., bnb_4bit_use_double_quant=True or False)"
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
        "load_in_8bit=True": quantization_config.load_in_8bit,
        "neither load_in_4bit nor load_in_8bit": not quantization_config.load_in_4bit,
        f"bnb_4bit_quant_storage={quantization_config.bnb_4bit_quant_storage}": (
            quantization_config.bnb_4bit_quant_storage != torch.uint8
        ),
        "llm_int8_enable_fp32_cpu_offload=True": quantization_config.llm_int8_enable_fp32_cpu_offload,
    }  # fmt: skip
    for setting, present in refused.items():
        if present:
            raise TypeError(
                f"hf_rtp.from_pretrained does not take a BitsAndBytesConfig with {setting}: {SUPPORTED} "
                "(the packed bytes are stored as uint8; hf_rtp shards them by rows itself)"
            )
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    except ImportError as err:
        raise ImportError(f"quantization_config needs bitsandbytes: pip install bitsandbytes ({err})") from err
    return quantization_config


def select(model: Any, resolution, config, dtype: torch.dtype, rtp_size: int) -> dict[str, Quant4bit]:
    """The modules transformers would make Linear4bit, each with what computing it needs; the biases of those
    modules become replicated parameters in `resolution` (read whole, as vanilla holds them)."""
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
    spec = Quant4bit(config.bnb_4bit_quant_type, BLOCKSIZE, dtype, config.bnb_4bit_compute_dtype)
    chosen: dict[str, Quant4bit] = {}
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
        if module.in_features % BLOCKSIZE:
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


def quantizers(chosen: dict[str, Quant4bit]) -> dict:
    """Parameter name -> what turns its rows, as read, into this rank's piece (before double quantization)."""
    return {f"{name}.weight": functools.partial(_quantized_piece, spec=spec) for name, spec in chosen.items()}


def _quantized_piece(rows: torch.Tensor, spec: Quant4bit) -> torch.Tensor:
    return piece_of(*quantize_rows(rows, spec))


def finish(model: Any, chosen: dict[str, Quant4bit], tensors: dict, config, topology) -> None:
    """Collective, after the read: double quantization (its offset is the whole tensor's mean, so the ranks
    gather each weight's absmax, about 3% of its bf16 bytes, one tensor at a time), then the meta weights
    reshaped to the pieces' [out_features, bytes per row] so that install makes them rotated parameters."""
    for name in sorted(chosen):
        module = model.get_submodule(name)
        columns = module.in_features // 2
        if config.bnb_4bit_use_double_quant:
            piece = tensors[f"{name}.weight"]
            absmax = piece[:, columns:].contiguous().view(torch.float32)
            shape = torch.Size((module.out_features, absmax.shape[1]))
            gathered = DTensor.from_local(absmax, topology.mesh, [Shard(0)], run_check=False, shape=shape,
                                          stride=torch.empty(shape, device="meta").stride())  # fmt: skip
            start, end = chunk_rows(module.out_features, topology.rtp_size, topology.rtp_rank)
            restored = quantize_double(whole(gathered))[start:end]
            tensors[f"{name}.weight"] = piece_of(piece[:, :columns], restored)
        width = packed_columns(module.in_features, chosen[name])
        module.weight = nn.Parameter(
            torch.empty(module.out_features, width, dtype=torch.uint8, device="meta"), requires_grad=False
        )


def swap_modules(model: Any, chosen: dict[str, Quant4bit], config) -> None:
    """After install: each chosen rotated linear becomes its 4-bit kind; the model says it is loaded in 4 bits,
    as vanilla's does (PEFT's prepare_model_for_kbit_training reads it)."""
    for name, spec in chosen.items():
        model.set_submodule(name, RotatedLinear4bit(cast(RotatedLinear, model.get_submodule(name)), spec=spec))
    model.is_loaded_in_4bit = True
    model.config.quantization_config = config
