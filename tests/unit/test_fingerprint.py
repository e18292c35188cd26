"""hf_rtp/checkpoint/fingerprint.py's pure parts: what the fingerprint ranks compare depends on (and does not), which
ranks `_to_hash` picks to hash a file whole, and the one-process checks against a Hub blob's recorded SHA-256 and
a file rewritten during the read. (Ranks that differ: tests/faults/test_ranks_agree_on_bytes.py.)"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from hf_rtp.checkpoint.fingerprint import (
    _to_hash,
    agree,
    agree_on_read,
    fingerprint,
    hash_file,
    prove_files,
    tensor_digest,
)
from hf_rtp.checkpoint.safetensors_io import read_header
from hf_rtp.errors import CheckpointError
from hf_rtp.plans import Plan

TENSORS = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


def _checkpoint(folder, tensors=TENSORS, **config):
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    cfg = LlamaConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, **config)
    cfg._name_or_path = str(folder)
    return cfg, read_header(os.path.join(folder, "model.safetensors"))


def _print(cfg, entries, **changes):
    settings = dict(
        commit=None, config=cfg, entries=entries, plan="auto", piece_bytes=16 << 20, dtype=torch.float32, verify="auto"
    )
    return fingerprint(**{**settings, **changes})


def test_a_byte_identical_copy_elsewhere_has_the_same_fingerprint_and_each_setting_shows_where_it_differs(tmp_path):
    here = _print(*_checkpoint(tmp_path / "a"))
    assert here == _print(*_checkpoint(tmp_path / "b"))  # another folder: _name_or_path is not the checkpoint
    assert here["revision"] == "a local folder" and here["reduce_dtype"] == "torch.float32"

    def differs(other):
        return {k for k in here if here[k] != other[k]}

    cfg, entries = _checkpoint(tmp_path / "a")
    assert differs(_print(*_checkpoint(tmp_path / "c", rms_norm_eps=1e-5))) == {"config"}
    assert differs(_print(*_checkpoint(tmp_path / "d", {**TENSORS, "b": torch.ones(6)}))) == {
        "tensor names, shapes and dtypes",
        "weight file headers",
    }
    same_shapes = {"a": TENSORS["a"] + 1, "b": TENSORS["b"]}  # other values: the header records the same
    assert differs(_print(*_checkpoint(tmp_path / "e", same_shapes))) == set()  # bytes are proven by prove_files
    assert differs(_print(cfg, entries, piece_bytes=1 << 20)) == {"rotation_piece_size"}
    assert differs(_print(cfg, entries, reduce_dtype=torch.bfloat16)) == {"reduce_dtype"}
    assert differs(_print(cfg, entries, commit="abc123")) == {"revision"}
    assert differs(_print(cfg, entries, verify="full")) == {"verify_weights"}
    plan = Plan(name="mine", rotate={"lm_head": "linear"}, replicate=("model.norm.weight",))
    other = Plan(name="mine", rotate={"lm_head": "linear"}, replicate=())
    assert _print(cfg, entries, plan=plan)["plan"].startswith("mine #")
    assert differs(_print(cfg, entries, plan=plan)) == {"plan"}
    assert _print(cfg, entries, plan=plan)["plan"] != _print(cfg, entries, plan=other)["plan"]  # the rules count
    assert _print(cfg, entries, plan=plan) == _print(cfg, entries, plan=plan)  # and stably so


def _rank(identity, hub=None, blocks=False):
    return {"model.safetensors": (identity, hub, blocks), "other.safetensors": (identity, hub, blocks)}


SHARED, COPY_A, COPY_B = (1, 100, 5), (2, 100, 5), (3, 100, 5)  # (inode, size, mtime)
SHA = "a" * 64


@pytest.mark.parametrize(
    "everyone, expected",
    [
        ([_rank(SHARED)] * 4, {}),  # one shared file: nothing to hash
        ([_rank(COPY_A, SHA), _rank(COPY_B, SHA)], {}),  # two caches, one Hub blob hash
        ([_rank(COPY_A, blocks=True), _rank(COPY_B, blocks=True)], {}),  # hf_rtp's block digests
        # copies without a recorded hash: one rank per copy, spread over the ranks sharing it
        (
            [_rank(COPY_A), _rank(COPY_A), _rank(COPY_B), _rank(COPY_B)],
            {"model.safetensors": [0, 2], "other.safetensors": [1, 3]},
        ),
        ([_rank(COPY_A, SHA), _rank(COPY_B)], {"model.safetensors": [0, 1], "other.safetensors": [0, 1]}),
        ([_rank(COPY_A, SHA), _rank(COPY_B, "b" * 64)], {"model.safetensors": [0, 1], "other.safetensors": [0, 1]}),
    ],
)
def test_only_copies_nothing_else_proves_equal_are_hashed_whole_one_rank_per_copy(everyone, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        assert _to_hash(everyone, "auto") == expected
    assert ("one rank per copy hashes each file whole" in caplog.text) == bool(expected)


def test_full_verification_hashes_every_file_even_a_shared_one_spread_over_the_ranks(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        assert _to_hash([_rank(SHARED, SHA, blocks=True)] * 3, "full") == {
            "model.safetensors": [0],
            "other.safetensors": [1],
        }
    assert caplog.text == ""  # asked for: no warning


def _blob(tmp_path, data: bytes, recorded: str):
    """A Hub cache: the snapshot's file links to a blob named by the SHA-256 the Hub recorded."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / recorded).write_bytes(data)
    (snapshot / "model.safetensors").symlink_to(blobs / recorded)
    return read_header(str(snapshot / "model.safetensors"))


def test_full_verification_in_one_process_checks_a_hub_blob_against_its_name(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path))
    data = path.read_bytes()
    good = _blob(tmp_path / "good", data, hashlib.sha256(data).hexdigest())
    assert hash_file(good["a"]) == hashlib.sha256(data).hexdigest()
    assert set(prove_files(good, None, verify="full")) == {"model.safetensors"}
    damaged = _blob(tmp_path / "damaged", data[:-4] + b"\0\0\0\1", hashlib.sha256(data).hexdigest())
    prove_files(damaged, None)  # "auto" trusts the cache, as documented in docs/reliability.md
    with pytest.raises(CheckpointError, match="does not match the SHA-256 the Hub recorded for it"):
        prove_files(damaged, None, verify="full")


def test_a_file_rewritten_between_the_proof_and_the_end_of_the_read_is_an_error(tmp_path):
    cfg, entries = _checkpoint(tmp_path / "a")
    identities = prove_files(entries, None)
    agree_on_read({}, identities, entries, None)  # unchanged: fine
    agree(_print(cfg, entries), None)  # one process: nothing to compare
    path = tmp_path / "a" / "model.safetensors"
    shutil.copy(path, tmp_path / "copy")
    os.replace(tmp_path / "copy", path)  # the same bytes, another file
    with pytest.raises(CheckpointError, match=r"model\.safetensors changed while it was being read"):
        agree_on_read({}, identities, entries, None)


def test_a_tensor_digest_is_the_sha256_of_its_bytes_as_stored():
    t = torch.arange(6, dtype=torch.int16)
    assert tensor_digest(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(wide.t()) == hashlib.sha256(wide.t().contiguous().numpy().tobytes()).hexdigest()
    assert tensor_digest(torch.zeros(0, 3)) == hashlib.sha256(b"").hexdigest()
    assert tensor_digest(torch.tensor([1.0], dtype=torch.bfloat16)) == hashlib.sha256(b"\x80\x3f").hexdigest()
