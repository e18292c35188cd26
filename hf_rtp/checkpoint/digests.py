"""Per-block digests of a safetensors file's data, so that a rank reading 1/N of a file can prove its
rows are the bytes that were saved.

Files hf_rtp writes carry, in the safetensors header's `__metadata__` (which vanilla transformers and
the safetensors library pass over), the block size and a 128-bit SHA-256 prefix of every 1 MiB block
of the data section. A rank verifies every block its reads touch: the edges of a read that end
inside a block are read whole (at most two extra blocks per read). Ranks compare file headers, so
verified rows on every rank mean bytes of one and the same file. Vanilla-saved files have no
digests; fingerprint.py proves their bytes another way.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import CheckpointError

BLOCK_BYTES = 1 << 20
SIZE_KEY, DIGESTS_KEY = "hf_rtp.block_bytes", "hf_rtp.block_sha256"
_HEX = 32  # characters per block: the first 128 bits of its SHA-256


def _blocks(total: int, block: int) -> int:
    return -(-total // block)


def _digest(data) -> str:
    return hashlib.sha256(data).hexdigest()[:_HEX]


class BlockHasher:
    """Digests of a data section written front to back (the streaming writer feeds it as it writes)."""

    def __init__(self, total: int, block: int = BLOCK_BYTES):
        self.block, self._current, self._filled = block, hashlib.sha256(), 0
        self._out: list[str] = []

    @staticmethod
    def metadata(total: int, digests: str | None = None, block: int = BLOCK_BYTES) -> dict[str, str]:
        """What the header records; with digests=None a placeholder of the same length, so the header
        can be written before the data and rewritten in place after it."""
        return {SIZE_KEY: str(block), DIGESTS_KEY: digests or "0" * (_HEX * _blocks(total, block))}

    def update(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            take = min(len(data), self.block - self._filled)
            self._current.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.block:
                self._close_block()

    def hexdigests(self) -> str:
        if self._filled:
            self._close_block()
        return "".join(self._out)

    def _close_block(self) -> None:
        self._out.append(self._current.hexdigest()[:_HEX])
        self._current, self._filled = hashlib.sha256(), 0


@dataclass(frozen=True)
class BlockDigests:
    path: str
    data_start: int
    data_size: int
    block: int
    digests: str

    @classmethod
    def from_metadata(cls, path: str, data_start: int, data_size: int, metadata) -> BlockDigests | None:
        if not isinstance(metadata, dict) or DIGESTS_KEY not in metadata:
            return None
        block, digests = metadata.get(SIZE_KEY), metadata[DIGESTS_KEY]
        size = int(block) if isinstance(block, str) and block.isdigit() else 0
        valid = (
            4096 <= size <= 1 << 30
            and isinstance(digests, str)
            and len(digests) == _HEX * _blocks(data_size, size)
            and re.fullmatch(r"[0-9a-f]*", digests)
        )
        if not valid:
            raise CheckpointError(
                f"{path} carries block digests that do not fit its data: it is damaged, save it again"
            )
        return cls(path, data_start, data_size, size, digests)

    def verify(self, offset: int, data: memoryview) -> None:
        """Check bytes `data`, read from absolute file position `offset`, against the recorded blocks;
        inside `overlapped()`, on a worker thread while the caller reads on."""
        if _overlap is not None:
            _overlap.submit(self._verify, offset, data)
        else:
            self._verify(offset, data)

    def _verify(self, offset: int, data: memoryview) -> None:
        data = data.cast("B")
        begin, end = offset - self.data_start, offset - self.data_start + len(data)
        if not len(data):
            return
        fd = None
        try:
            for k in range(begin // self.block, (end - 1) // self.block + 1):
                lo, hi = k * self.block, min((k + 1) * self.block, self.data_size)
                if begin <= lo and hi <= end:
                    got = _digest(data[lo - begin : hi - begin])
                else:  # a read that starts or ends inside the block: read the block whole
                    fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
                    whole = os.pread(fd, hi - lo, self.data_start + lo)
                    a, b = max(lo, begin), min(hi, end)
                    if whole[a - lo : b - lo] != data[a - begin : b - begin]:
                        got = "changed while being read"
                    else:
                        got = _digest(whole)
                if got != self.digests[k * _HEX : (k + 1) * _HEX]:
                    raise CheckpointError(
                        f"{self.path}: bytes {self.data_start + lo}-{self.data_start + hi} do not match the digest "
                        "hf_rtp "
                        "recorded when it saved the file: the file is damaged, or was changed after it was saved. "
                        "Copy or save the checkpoint again"
                    )
        finally:
            if fd is not None:
                os.close(fd)


class _Overlap:
    """Verification on worker threads (hashlib releases the GIL), at most `limit` bytes behind the reads."""

    def __init__(self, pool: ThreadPoolExecutor, limit: int):
        self.pool, self.limit = pool, limit
        self.futures: list[Future] = []
        self.room = threading.BoundedSemaphore(max(1, limit // BLOCK_BYTES))

    def submit(self, verify, offset: int, data: memoryview) -> None:
        units = max(1, min(len(data) // BLOCK_BYTES, self.limit // BLOCK_BYTES))
        for _ in range(units):
            self.room.acquire()

        def job():
            try:
                verify(offset, data)
            finally:
                for _ in range(units):
                    self.room.release()

        self.futures.append(self.pool.submit(job))


_overlap: _Overlap | None = None


@contextmanager
def overlapped(limit: int = 256 << 20):
    """Within this block (one reader thread), block checks run beside the reads; leaving it waits for
    them all and raises the first mismatch. Bytes being checked stay referenced until checked."""
    global _overlap
    with ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) - 1))) as pool:
        _overlap = _Overlap(pool, limit)
        try:
            yield
        finally:
            futures, _overlap = _overlap.futures, None
            for future in futures:
                future.result()
