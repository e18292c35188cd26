"""Checkpoints vanilla saved after quantizing with bitsandbytes (`save_pretrained` of a 4-bit or 8-bit model, as the
Hub's `*-bnb-4bit` repositories are): each rank reads its rows of the stored packed bytes (int8 codes) and their
scales, never a whole tensor, into the piece layers/linear4bit.py (linear8bit.py) computes with; nothing is
quantized again.

4-bit weights are stored flattened, half a byte per weight, with one absmax per 64 consecutive weights; a row of
`in_features` (a multiple of 64) is `in_features / 2` bytes and `in_features / 64` scales, so a rank's rows are
contiguous ranges of both. Under double quantization the absmax are stored as 8-bit codes with one float32
scale per 256 of them and one offset for the tensor (its `quant_state` JSON); a rank dequantizes its rows'
codes element by element, as bitsandbytes' dequantize_blockwise does, to the float32 absmax vanilla's matmul
uses. 8-bit weights are int8 rows with one float32 scale (SCB) per row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ..layers.linear4bit import BLOCKSIZE, Quant4bit, piece_of
from ..layers.linear8bit import SCALE_BYTES, Quant8bit
from .conversion import Source
from .safetensors_io import read_rows

_QUANT_STATE = re.compile(r"\.weight\.quant_state\.bitsandbytes__(nf4|fp4)$")


class QuantizedLoad(Protocol):
    """What a load does for its quantization, whatever it is: the loader (hf_rtp/loader.py) calls these in this
    order on every load, and a load without quantization is `NOT_QUANTIZED`, which does nothing.
    bitsandbytes' 4-bit and 8-bit bases are the one implementation (integrations/bitsandbytes.py)."""

    config: Any
    """what the model's config records as its quantization_config (None: not quantized)"""

    def plan(self, model: Any, resolution: Any, dtype: torch.dtype, rtp_size: int) -> None:
        """On the empty model, before any read: which modules are quantized (refusing, by name, what cannot be)."""

    def transforms(self, model: Any, wants: dict, entries: dict) -> dict | None:
        """Reads a file step may fail: name -> what turns a tensor's rows, as read, into this rank's piece; or
        the reads themselves pointed at a checkpoint's stored quantized tensors (`wants` changed in place)."""

    def finish(self, model: Any, tensors: dict, topology: Any) -> None:
        """Collective, after the read: what needs every rank's pieces; the empty weights shaped as the pieces."""

    def install(self, model: Any) -> None:
        """After the rotated modules are installed: the quantized modules swapped in, the model marked as vanilla's."""


class _NotQuantized:
    config = None

    def plan(self, model: Any, resolution: Any, dtype: torch.dtype, rtp_size: int) -> None:
        pass

    def transforms(self, model: Any, wants: dict, entries: dict) -> dict | None:
        return None

    def finish(self, model: Any, tensors: dict, topology: Any) -> None:
        pass

    def install(self, model: Any) -> None:
        pass


NOT_QUANTIZED: QuantizedLoad = _NotQuantized()


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
        floating = isinstance(stored_dtype, torch.dtype) and stored_dtype.is_floating_point
        if not isinstance(stored_dtype, torch.dtype) or not floating or state.get("blocksize") != BLOCKSIZE:
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
