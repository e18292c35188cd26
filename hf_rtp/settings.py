"""Everything from_pretrained's keywords and the HF_RTP_* variables configure, parsed and validated here.

    HF_RTP_TIMEOUT        timeout=: how long any collective hf_rtp issues may wait (default 10 minutes)
    HF_RTP_ENTRY_TIMEOUT  how long a call every rank must make waits for the ranks that skip it (60 s)
    HF_RTP_FAULT          a fault to inject at a named point (tests): parsed and validated in faults.py
    HF_RTP_NO_RENAME_EXCHANGE  tests only: the folder swap takes its fallback path (folders/atomic.py)

A bad value is an error that names the keyword or variable, raised before any process group exists.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch

from .errors import SettingError, TopologyError

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_ENTRY_TIMEOUT = timedelta(seconds=60)
DEFAULT_PIECE_SIZE = "16MB"
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400.0
VERIFY_MODES = ("auto", "full")
MOVES = ("auto", "weights", "activations")  # rotation_moves
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _keyword(name: str) -> dict:
    return {"keyword": name}  # the from_pretrained keyword a field comes from: what LoadSpec passes on


@dataclass(frozen=True)
class Settings:
    device: torch.device = field(metadata=_keyword("device"))
    """where parameters live: this rank's GPU (LOCAL_RANK) when CUDA is present, else the CPU"""
    timeout: timedelta = field(metadata=_keyword("timeout"))
    """timeout= or HF_RTP_TIMEOUT: every group hf_rtp makes carries it"""
    entry_timeout: timedelta
    """HF_RTP_ENTRY_TIMEOUT: where calls every rank must make meet"""
    piece_bytes: int = field(metadata=_keyword("rotation_piece_size"))
    """rotation_piece_size: chunks larger than this walk the ring in pieces"""
    verify_weights: str = field(metadata=_keyword("verify_weights"))
    """how ranks prove they read one checkpoint's bytes ("auto" or "full")"""
    fused_loss: bool = field(metadata=_keyword("fused_loss"))
    reduce_dtype: torch.dtype | None = field(default=None, metadata=_keyword("reduce_dtype"))
    """what rotated gradients travel and are summed in (None: the parameter's dtype)"""
    rotation_moves: str = field(default="auto", metadata=_keyword("rotation_moves"))
    """what a rotated op moves around the ring in a forward: "auto" (whichever costs less: bytes and hops, the
    weight pieces or the tokens), "weights" or "activations" (distributed.transport.weights_or_tokens.Traffic)"""
    tiled_mlp: bool | int | str = field(default="auto", metadata=_keyword("tiled_mlp"))
    """whether decoder layers' MLPs, and the model's norms, run over tiles of their tokens: "auto", True, False or
    tokens per tile (model/tiled_mlp.py)"""

    def load_spec(self, device_mesh: Any, rtp_size: int, plan: Any) -> LoadSpec:
        """How a model was loaded with these settings, on this grid with this plan (model.state.RTPState.spec)."""
        return LoadSpec(self, device_mesh, rtp_size, plan)

    @classmethod
    def resolve(
        cls,
        device: str | torch.device | None = None,
        timeout: float | timedelta | None = None,
        rotation_piece_size: int | str = DEFAULT_PIECE_SIZE,
        verify_weights: str = "auto",
        fused_loss: bool = True,
        reduce_dtype: str | torch.dtype | None = None,
        rotation_moves: str = "auto",
        tiled_mlp: bool | int | str = "auto",
    ) -> Settings:
        if not (tiled_mlp == "auto" or isinstance(tiled_mlp, bool) or (type(tiled_mlp) is int and tiled_mlp > 0)):
            raise SettingError(
                f'tiled_mlp must be "auto", True, False or a positive number of tokens per tile, got {tiled_mlp!r}'
            )
        if rotation_moves not in MOVES:
            raise SettingError(f"rotation_moves must be one of {', '.join(map(repr, MOVES))}, got {rotation_moves!r}")
        if verify_weights not in VERIFY_MODES:
            raise SettingError(f"verify_weights must be 'auto' or 'full', got {verify_weights!r}")
        if isinstance(reduce_dtype, str):
            reduce_dtype = getattr(torch, reduce_dtype, reduce_dtype)
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise SettingError(
                f"reduce_dtype must be None or a floating torch dtype such as torch.float32, got {reduce_dtype!r}"
            )
        return cls(
            device=resolve_device(device),
            timeout=collective_timeout(timeout),
            entry_timeout=as_timedelta(None, "HF_RTP_ENTRY_TIMEOUT", DEFAULT_ENTRY_TIMEOUT),
            piece_bytes=parse_size(rotation_piece_size, "rotation_piece_size"),
            verify_weights=verify_weights,
            fused_loss=bool(fused_loss),
            reduce_dtype=reduce_dtype,
            rotation_moves=rotation_moves,
            tiled_mlp=tiled_mlp,
        )


@dataclass(frozen=True)
class LoadSpec:
    """How a model was loaded: its settings, grid and plan. What a second load "like it" passes to from_pretrained
    (TRL's reference model, integrations/trl.py): data handed down with the model, not a function of the layer
    above."""

    settings: Settings
    device_mesh: Any
    """the device_mesh= passed (None: hf_rtp made the mesh)"""
    rtp_size: int
    plan: Any
    """the Plan the model was loaded with, or the string auto"""

    def keywords(self) -> dict[str, Any]:
        """from_pretrained's keywords for another model like this one: every Settings field a keyword sets."""
        given = {f.metadata["keyword"]: getattr(self.settings, f.name) for f in fields(Settings) if f.metadata}
        return {**given, "device_mesh": self.device_mesh, "rtp_size": self.rtp_size, "plan": self.plan}


def collective_timeout(value: float | timedelta | None = None) -> timedelta:
    """timeout=, else HF_RTP_TIMEOUT, else 10 minutes: also what hf_rtp.Accelerator and the recipes give
    the process group they create."""
    return as_timedelta(value, "HF_RTP_TIMEOUT", DEFAULT_TIMEOUT)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Default: this process's GPU (LOCAL_RANK) when CUDA is present, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def as_timedelta(value: float | timedelta | None, variable: str, default: timedelta) -> timedelta:
    """`value`, else the environment variable, else `default`. Seconds, or with a unit: "90s", "10m", "1h", "2d".

    Between 1 second (less cannot even open a connection between ranks) and 7 days (more overflows
    the process group's clock, and is a hang in all but name); anything else names the setting."""
    given: float | timedelta | str | None = value
    if given is None:
        given = os.environ.get(variable) or None
        if given is None:
            return default
    if isinstance(given, timedelta):
        seconds = given.total_seconds()
    elif isinstance(given, (int, float)) and not isinstance(given, bool):
        seconds = float(given)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", str(given).lower())
        seconds = (
            float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
            if match
            else float("nan")
        )
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise TopologyError(
            f"{variable}{' (or timeout=)' if variable == 'HF_RTP_TIMEOUT' else ''} must be a duration from 1 second "
            "to 7 days: seconds like 600, or 90s, 10m, 1h, "
            f"2d; got {given!r}"
        )
    return timedelta(seconds=seconds)


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """'5GB' -> 5 * 10**9 and '5GiB' -> 5 * 2**30, as transformers reads max_shard_size."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", size.upper()) if isinstance(size, str) else None
    if not match or float(match.group(1)) <= 0:
        raise SettingError(f"{what} must be a positive number of bytes or a size like '5GB', got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
