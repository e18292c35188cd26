"""Read row slices from and stream tensors into safetensors files, without mmap and without pickle.

Format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw bytes. Dim-0 rows of a tensor are contiguous, so a rank reads its chunk with one
positioned read (I6). We avoid mmap on purpose: pages of a mapped file that a rank touches count
in its resident memory for as long as the map lives, which would double a rank's load peak.
The header is checked against the file size, so a truncated or corrupt file is an error that names
the file, never garbage weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    path: str
    name: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    """absolute byte position of the first element in the file"""

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _corrupt(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file ({why}). It is probably truncated or corrupted: "
        "download or save it again."
    )


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse and validate a safetensors header; every tensor must lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"{size} bytes, too short for a header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(_MAX_HEADER, size - 8):  # the number would only echo the file's first bytes
            raise _corrupt(path, f"it does not start with a safetensors header that fits its {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _corrupt(path, f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = torch.Size(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad header entry for {name}: {info!r}") from None
        entry = TensorEntry(path, name, dtype, shape, data_start + begin)
        if end - begin != entry.nbytes or begin < 0 or min(shape, default=0) < 0:
            raise _corrupt(path, f"{name} has {end - begin} bytes for shape {list(shape)} {info['dtype']}")
        if end > data_size:
            raise _corrupt(path, f"{name} ends at byte {end} of the data but the file holds only {data_size}")
        entries[name] = entry
        spans.append((begin, end, name))
    _check_layout(path, spans, data_size)
    return entries


def _check_layout(path: str, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Tensors tile the data exactly, as the safetensors library requires: no two share bytes
    (one write would change both), no gap, nothing after the last one."""
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != position:
            what = f"overlaps {previous}" if begin < position else f"leaves a gap of {begin - position} bytes"
            raise _corrupt(path, f"{name} (bytes {begin}-{end}) {what}")
        position, previous = end, name
    if position != data_size:
        raise _corrupt(path, f"{data_size - position} bytes after the last tensor")


def read_rows(
    entry: TensorEntry, start: int | None = None, end: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [start, end) of a tensor (all of it by default), into `out` (contiguous CPU) or a new tensor."""
    if entry.shape and start is not None:
        shape = torch.Size((end - start, *entry.shape[1:]))
        offset = entry.offset + start * entry.row_bytes
    else:
        shape, offset = entry.shape, entry.offset
    if out is None:
        out = torch.empty(shape, dtype=entry.dtype)
    elif out.dtype != entry.dtype or out.numel() != math.prod(shape) or not out.is_contiguous():
        raise ValueError(f"cannot read {entry.name} {list(shape)} {entry.dtype} into {list(out.shape)} {out.dtype}")
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise _corrupt(entry.path, f"unexpected end of file while reading {entry.name}")
            done += n
    finally:
        os.close(fd)
    return out


class StreamingWriter:
    """Write a safetensors file one tensor at a time: the header is known before any data is."""

    def __init__(self, path: str, layout: list[tuple[str, torch.dtype, torch.Size]], metadata: dict[str, str]):
        header: dict = {"__metadata__": dict(metadata)}
        offset = 0
        self._order = []
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8-byte alignment
        self._file = open(path, "wb")
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._next = 0

    def write(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write tensor `name` from consecutive dim-0 pieces, each written as soon as it arrives."""
        expected, nbytes = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"tensors must be written in header order: expected {expected}, got {name}")
        written = 0
        for part in parts:
            blob = part.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            if blob.numel():
                self._file.write(memoryview(blob.numpy()))
            written += blob.numel()
        if written != nbytes:
            raise RuntimeError(f"{name}: {written} bytes, header says {nbytes}")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"closed after {self._next} of {len(self._order)} tensors")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
