"""Read row slices from and stream tensors into safetensors files, without mmap and without pickle.

Format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw bytes. Dim-0 rows of a tensor are contiguous, so a rank reads its chunk with one
positioned read (DESIGN.md I6). We avoid mmap on purpose: pages of a mapped file that a rank touches count
in its resident memory for as long as the map lives, which would double a rank's load peak.
The header is checked against the file size, so a truncated or corrupt file is an error that names
the file, never garbage weights.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .digests import BLOCK_BYTES, BlockDigests, BlockHasher

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
# Bounds on what a header may make us parse, checked on its raw bytes before any parser runs: a
# 90 MB header of 30 million empty objects would otherwise cost gigabytes on every rank. The
# largest real checkpoints hold tens of thousands of tensors per file (per-expert MoE weights).
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_TENSORS = 200_000  # per file: each tensor's entry is one JSON object
MAX_SEPARATORS = 4_000_000  # '{', '[' and ',' together: about 10 per tensor in a real header


@dataclass(frozen=True)
class TensorEntry:
    path: str
    name: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    """absolute byte position of the first element in the file"""
    blocks: BlockDigests | None = None
    """the file's block digests, when hf_rtp wrote it: every read is verified against them"""

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
    """Parse and validate a safetensors header; every tensor must lie inside the file.

    Bounded before parsing (size, objects, separators), then held to everything the safetensors
    library requires: a file it refuses (float or negative offsets, unknown dtypes, nesting, trailing
    bytes) is a CheckpointError here too, never a looser read."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _corrupt(path, "it is not a regular file")
    size = st.st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"{size} bytes, too short for a header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):  # the number would only echo the file's first bytes
            raise _corrupt(path, f"it does not start with a safetensors header that fits its {size} bytes")
        _check_bounds(path, f, header_len)
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise _corrupt(path, f"header is not JSON: {str(err)[:200]}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    blocks = BlockDigests.from_metadata(path, data_start, data_size, header.get("__metadata__"))
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = torch.Size(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad header entry for {name}: {str(info)[:200]}") from None
        entry = TensorEntry(path, name, dtype, shape, data_start + begin, blocks)
        if end - begin != entry.nbytes or begin < 0 or min(shape, default=0) < 0:
            raise _corrupt(path, f"{name} has {end - begin} bytes for shape {list(shape)} {info['dtype']}")
        if end > data_size:
            raise _corrupt(path, f"{name} ends at byte {end} of the data but the file holds only {data_size}")
        entries[name] = entry
        spans.append((begin, end, name))
    _check_layout(path, spans, data_size)
    _check_with_library(path)
    return entries


def _check_bounds(path: str, f, header_len: int) -> None:
    """Count the header's objects and separators in 1 MB steps, before any of it is held or parsed."""
    objects = separators = 0
    for _ in range(0, header_len, 1 << 20):
        chunk = f.read(min(1 << 20, header_len - f.tell() + 8))
        objects += chunk.count(b"{")
        separators += chunk.count(b"{") + chunk.count(b"[") + chunk.count(b",")
        if objects > MAX_TENSORS + 2 or separators > MAX_SEPARATORS:
            raise _corrupt(
                path,
                f"its header holds more than {MAX_TENSORS} JSON objects or {MAX_SEPARATORS} separators, beyond what a "
                "real checkpoint file holds; refusing to parse it",
            )
    f.seek(8)


def _check_with_library(path: str) -> None:
    """The safetensors library's own verdict (it parses the header only; the data stays unread)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as err:  # SafetensorError, and whatever a future version raises
        raise _corrupt(path, f"the safetensors library refuses it: {str(err)[:300]}") from None


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
    """Rows [start, end) of a tensor (all of it by default; `end` defaults to the last row), into `out`
    (contiguous CPU) or a new tensor."""
    if entry.shape and start is not None:
        end = entry.shape[0] if end is None else end
        shape = torch.Size((end - start, *entry.shape[1:]))
        offset = entry.offset + start * entry.row_bytes
    else:
        shape, offset = entry.shape, entry.offset
    if out is None:
        out = torch.empty(shape, dtype=entry.dtype)
    elif out.dtype != entry.dtype or out.numel() != math.prod(shape) or not out.is_contiguous():
        raise ValueError(f"cannot read {entry.name} {list(shape)} {entry.dtype} into {list(out.shape)} {out.dtype}")
    view = out.view(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(b"")
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
    if entry.blocks is not None:
        entry.blocks.verify(offset, view)
    return out


class StreamingWriter:
    """Write a safetensors file one tensor at a time: the header is known before any data is. The data
    is hashed as it streams past (digests.py) and the header, written first with a placeholder of
    the same length, is rewritten with the block digests when the file is closed."""

    def __init__(
        self,
        path: str,
        layout: list[tuple[str, torch.dtype, torch.Size]],
        metadata: dict[str, str],
        block_bytes: int = BLOCK_BYTES,
    ):
        self._order, self._layout, self._block, offset = [], layout, block_bytes, 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            self._order.append((name, nbytes))
            offset += nbytes
        self._metadata, self._total = dict(metadata), offset
        self._hasher = BlockHasher(offset, block_bytes)
        encoded = self._header(None)
        self._file = open(path, "wb")  # noqa: SIM115 (the writer owns it across write() calls; close() closes it)
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._header_bytes = len(encoded)
        self._next = 0

    def _header(self, digests: str | None) -> bytes:
        header: dict = {"__metadata__": {**self._metadata, **BlockHasher.metadata(self._total, digests, self._block)}}
        offset = 0
        for name, dtype, shape in self._layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        return encoded + b" " * (-len(encoded) % 8)  # the format pads the header to 8-byte alignment

    def write(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write tensor `name` from consecutive dim-0 pieces, each written as soon as it arrives."""
        expected, nbytes = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"tensors must be written in header order: expected {expected}, got {name}")
        written = 0
        for part in parts:
            blob = part.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            if blob.numel():
                view = blob.numpy().data
                self._file.write(view)
                self._hasher.update(view)
            written += blob.numel()
        if written != nbytes:
            raise RuntimeError(f"{name}: {written} bytes, header says {nbytes}")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"closed after {self._next} of {len(self._order)} tensors")
        final = self._header(self._hasher.hexdigests())
        assert len(final) == self._header_bytes, "digests changed the header's length"
        self._file.seek(8)
        self._file.write(final)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
