"""hf_rtp/checkpoint/digests.py's pure parts: a block's digest is the first 128 bits of the SHA-256 of exactly
that block's bytes, whatever pieces the writer fed it in; the header's placeholder has the final length; what a
header records is refused when it cannot describe the data; overlapped checks report a mismatch when the block
ends. (Digests checked on reads of real files: test_safetensors_io.py.)"""

from __future__ import annotations

import hashlib
import random

import pytest

from hf_rtp.checkpoint.digests import DIGESTS_KEY, SIZE_KEY, BlockDigests, BlockHasher, overlapped
from hf_rtp.errors import CheckpointError

BLOCK = 4096
DATA = random.Random(0).randbytes(3 * BLOCK + 123)  # three whole blocks and a short last one


def _by_hand(data: bytes, block: int) -> str:
    return "".join(hashlib.sha256(data[i : i + block]).hexdigest()[:32] for i in range(0, len(data), block))


@pytest.mark.parametrize("pieces", [[], [1, BLOCK - 1, BLOCK + 5, 7], [100] * 40, [BLOCK] * 3])
def test_digests_are_each_blocks_sha256_prefix_however_the_writes_are_cut(pieces):
    hasher, start = BlockHasher(len(DATA), BLOCK), 0
    for size in [*pieces, len(DATA) - sum(pieces)]:
        hasher.update(memoryview(DATA[start : start + size]))
        start += size
    assert start == len(DATA)
    assert hasher.hexdigests() == _by_hand(DATA, BLOCK)


def test_the_placeholder_has_the_length_of_the_digests_it_stands_for():
    placeholder = BlockHasher.metadata(len(DATA), block=BLOCK)
    hasher = BlockHasher(len(DATA), BLOCK)
    hasher.update(memoryview(DATA))
    final = BlockHasher.metadata(len(DATA), hasher.hexdigests(), block=BLOCK)
    assert placeholder.keys() == final.keys() == {SIZE_KEY, DIGESTS_KEY}
    assert len(placeholder[DIGESTS_KEY]) == len(final[DIGESTS_KEY]) == 4 * 32  # the header is rewritten in place
    assert placeholder[SIZE_KEY] == final[SIZE_KEY] == "4096"
    assert BlockHasher.metadata(0, block=BLOCK)[DIGESTS_KEY] == ""


def _recorded(path, data=DATA, block=BLOCK) -> BlockDigests:
    with open(path, "wb") as f:
        f.write(b"H" * 8 + data)  # 8 bytes of "header" before the data section
    return BlockDigests.from_metadata(path, 8, len(data), {SIZE_KEY: str(block), DIGESTS_KEY: _by_hand(data, block)})


def test_metadata_that_cannot_describe_the_data_is_a_damaged_file_and_none_is_a_vanilla_file(tmp_path):
    path = str(tmp_path / "x")
    assert BlockDigests.from_metadata(path, 8, len(DATA), {"format": "pt"}) is None
    assert BlockDigests.from_metadata(path, 8, len(DATA), None) is None
    good = {SIZE_KEY: "4096", DIGESTS_KEY: _by_hand(DATA, BLOCK)}
    assert BlockDigests.from_metadata(path, 8, len(DATA), good).block == BLOCK
    for bad in (
        {SIZE_KEY: "1024"},  # below 4 KiB
        {SIZE_KEY: str(1 << 31)},  # above 1 GiB
        {SIZE_KEY: "4k"},
        {SIZE_KEY: 4096},  # metadata values are strings
        {DIGESTS_KEY: good[DIGESTS_KEY][:-32]},  # one block short
        {DIGESTS_KEY: good[DIGESTS_KEY].upper()},
    ):
        with pytest.raises(CheckpointError, match="carries block digests that do not fit its data"):
            BlockDigests.from_metadata(path, 8, len(DATA), {**good, **bad})


def test_a_read_inside_a_block_is_checked_against_the_whole_block(tmp_path):
    path = str(tmp_path / "x")
    digests = _recorded(path)
    digests.verify(8 + 100, memoryview(DATA[100:200]))  # inside block 0: the block is read whole and matches
    digests.verify(8 + BLOCK - 10, memoryview(DATA[BLOCK - 10 : 3 * BLOCK + 50]))  # across four blocks
    with open(path, "r+b") as f:
        f.seek(8 + 2 * BLOCK + 7)
        f.write(b"\xff" if DATA[2 * BLOCK + 7] != 0xFF else b"\x00")
    digests.verify(8, memoryview(DATA[:BLOCK]))  # block 0 is still good
    with pytest.raises(CheckpointError, match=f"bytes {8 + 2 * BLOCK}-{8 + 3 * BLOCK} do not match the digest"):
        digests.verify(8 + 2 * BLOCK + 100, memoryview(DATA[2 * BLOCK + 100 : 2 * BLOCK + 200]))


def test_bytes_that_differ_from_what_was_read_are_caught_even_when_the_block_was_read_whole(tmp_path):
    digests = _recorded(str(tmp_path / "x"))
    altered = bytearray(DATA[:BLOCK])
    altered[5] ^= 1  # the caller's bytes, not the file's
    with pytest.raises(CheckpointError, match="bytes 8-4104 do not match"):
        digests.verify(8, memoryview(bytes(altered)))
    with pytest.raises(CheckpointError, match="do not match"):
        digests.verify(8 + 3, memoryview(bytes(altered[3:50])))


def test_overlapped_checks_raise_the_first_mismatch_when_the_block_ends(tmp_path):
    digests = _recorded(str(tmp_path / "x"))
    with overlapped():
        for k in range(4):
            digests.verify(8 + k * BLOCK, memoryview(DATA[k * BLOCK : (k + 1) * BLOCK]))
    bad = bytearray(DATA[BLOCK : 2 * BLOCK])
    bad[0] ^= 1
    with pytest.raises(CheckpointError, match=f"bytes {8 + BLOCK}-{8 + 2 * BLOCK} do not match"), overlapped():
        digests.verify(8, memoryview(DATA[:BLOCK]))
        digests.verify(8 + BLOCK, memoryview(bytes(bad)))
    digests.verify(8, memoryview(DATA[:BLOCK]))  # after the block: checks run in the caller again
