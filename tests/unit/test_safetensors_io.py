import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hf_rtp.checkpoint.safetensors_io import CheckpointError, StreamingWriter, read_header, read_rows

TENSORS = {
    "a": torch.randn(7, 3),
    "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "c": torch.randn(5).to(torch.bfloat16),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
}


def test_reads_rows_of_files_written_by_safetensors(tmp_path):
    path = str(tmp_path / "x.safetensors")
    save_file(TENSORS, path)
    entries = read_header(path)
    assert set(entries) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert torch.equal(read_rows(entries[name]), tensor)
    assert torch.equal(read_rows(entries["a"], 2, 5), TENSORS["a"][2:5])
    assert read_rows(entries["a"], 7, 7).shape == (0, 3)
    assert torch.equal(read_rows(entries["a"], 2), TENSORS["a"][2:])  # end defaults to the last row


def test_streamed_file_is_read_by_safetensors(tmp_path):
    path = str(tmp_path / "y.safetensors")
    writer = StreamingWriter(path, [(n, t.dtype, t.shape) for n, t in TENSORS.items()], {"format": "pt"})
    for name, tensor in TENSORS.items():
        parts = [tensor[:2], tensor[2:]] if tensor.dim() else [tensor]
        writer.write(name, parts)
    writer.close()
    loaded = load_file(path)
    assert set(loaded) == set(TENSORS)
    assert all(torch.equal(loaded[n], t) for n, t in TENSORS.items())


def test_writer_refuses_out_of_order_or_short_data(tmp_path):
    writer = StreamingWriter(str(tmp_path / "z.safetensors"), [("a", torch.float32, torch.Size([2]))], {})
    with pytest.raises(RuntimeError, match="header order"):
        writer.write("b", [torch.zeros(2)])
    with pytest.raises(RuntimeError, match="header says 8"):
        writer.write("a", [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="closed after 0 of 1"):
        writer.close()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:4], "too short for a header"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "does not start with a safetensors header"),
        (lambda b: b[:-4], "ends at byte"),
    ],
)
def test_damaged_files_are_named_errors(tmp_path, damage, message):
    path = str(tmp_path / "d.safetensors")
    save_file({"a": torch.randn(4, 4)}, path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(damage(data))
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def _rewrite_header(path, edit, extra=b""):
    """Replace a safetensors file's header by `edit(header)`, keeping the data (plus `extra` bytes)."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = edit(json.loads(data[8 : 8 + n]))
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + n :] + extra)


def _shared(h):
    h["b"]["data_offsets"] = h["a"]["data_offsets"]  # b aliases a's bytes
    return h


def _gap(h):
    h["b"]["data_offsets"] = [h["b"]["data_offsets"][0] + 8, h["b"]["data_offsets"][1] + 8]
    return h


@pytest.mark.parametrize(
    "edit, extra, message",
    [
        (_shared, b"", "overlaps a"),
        (lambda h: h, b"\0" * 8, "8 bytes after the last tensor"),
        (_gap, b"\0" * 8, "gap of 8"),
    ],
)
def test_tensors_must_tile_the_data_as_safetensors_requires(tmp_path, edit, extra, message):
    path = str(tmp_path / "d.safetensors")
    save_file({"a": torch.zeros(2, 2), "b": torch.ones(2, 2)}, path)
    _rewrite_header(path, edit, extra)
    with pytest.raises(SafetensorError):  # the reference: the safetensors library refuses each of these files
        load_file(path)
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def _written(path, tensors, block_bytes=4096):
    writer = StreamingWriter(path, [(n, t.dtype, t.shape) for n, t in tensors.items()], {"format": "pt"}, block_bytes)
    for name, tensor in tensors.items():
        writer.write(name, [tensor])
    writer.close()


def test_streamed_files_carry_block_digests_that_every_read_is_checked_against(tmp_path):
    path = str(tmp_path / "d.safetensors")
    tensors = {"a": torch.randn(300, 7), "b": torch.randn(1000, 3).to(torch.bfloat16)}  # 8400 + 6000 bytes
    _written(path, tensors)
    assert all(torch.equal(load_file(path)[n], t) for n, t in tensors.items())  # vanilla reads it as before
    entries = read_header(path)
    assert entries["a"].blocks is not None and entries["a"].blocks.block == 4096
    for start, end in [(0, 300), (1, 2), (140, 150), (145, 299), (299, 300)]:  # reads that end inside blocks
        assert torch.equal(read_rows(entries["a"], start, end), tensors["a"][start:end])
    assert torch.equal(read_rows(entries["b"], 7, 993), tensors["b"][7:993])
    with open(path, "r+b") as f:  # one flipped byte, inside b's rows 600-700
        f.seek(entries["b"].offset + 650 * entries["b"].row_bytes)
        f.write(b"\xff")
    assert torch.equal(read_rows(entries["b"], 0, 500), tensors["b"][:500])  # other blocks are still good
    with pytest.raises(CheckpointError, match="do not match the digest hf_rtp recorded"):
        read_rows(entries["b"], 651, 652)  # a single row of that block: the block is read whole and checked


def test_digests_that_do_not_fit_the_data_are_a_damaged_file(tmp_path):
    path = str(tmp_path / "d.safetensors")
    _written(path, {"a": torch.randn(300, 7)})
    _rewrite_header(path, lambda h: {**h, "__metadata__": {**h["__metadata__"], "hf_rtp.block_sha256": "00"}})
    with pytest.raises(CheckpointError, match="carries block digests that do not fit its data"):
        read_header(path)
