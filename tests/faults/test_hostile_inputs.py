"""Headers built to exhaust memory or the parser, misspelt test hooks and broken optional files: each a
clear error (or, where vanilla loads the model, a warning and the same model), never a raw traceback."""

import logging
import os
import resource

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from support.models import make_tiny_llama
from support.spawn import run_on_ranks
from transformers import AutoModelForCausalLM

import hf_rtp
from hf_rtp.checkpoint.safetensors_io import read_header


def _write(path, header: bytes, data: bytes = b""):
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)


def _refused_and_rss_growth(path):
    """Read a hostile header in a fresh rank; how much its resident memory grew meanwhile (MB)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_header(path)
        message = None
    except hf_rtp.CheckpointError as err:
        message = str(err)
    return message, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


HOSTILE = {  # the library refuses the first two; the third it parses, at hundreds of MB and seconds
    "30 million empty objects in 90 MB": lambda: b'{"a":[' + b"{}," * 29_999_999 + b"{}]}",
    "100k-deep nesting": lambda: b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a million tensors": lambda: (
        b"{" + b",".join(b'"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_000_000)) + b"}"
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_refused_before_memory_grows(tmp_path, case):
    path = str(tmp_path / "model.safetensors")
    _write(path, HOSTILE[case]())
    if case != "a million tensors":
        with (
            pytest.raises(SafetensorError),
            safe_open(path, framework="pt"),
        ):  # the reference: safetensors refuses these
            pass
    [(message, grown_mb)] = run_on_ranks(_refused_and_rss_growth, 1, path)
    assert message is not None and "not a valid safetensors file" in message, message
    assert "refusing to parse it" in message or "header is not JSON" in message, message
    assert grown_mb < 50, grown_mb


@pytest.mark.parametrize("offsets", [b"[0.0,16.0]", b"[0,1.6e1]", b"[-0,16]"])
def test_whatever_the_safetensors_library_refuses_is_refused(tmp_path, offsets):
    path = str(tmp_path / "x.safetensors")
    _write(path, b'{"a":{"dtype":"F32","shape":[4],"data_offsets":' + offsets + b"}}", b"\0" * 16)
    try:
        with safe_open(path, framework="pt"):
            accepted = True
    except Exception:
        accepted = False
    if accepted:
        assert read_header(path)["a"].shape == (4,)
    else:
        with pytest.raises(hf_rtp.CheckpointError, match="not a valid safetensors file"):
            read_header(path)


def test_a_misspelt_fault_point_is_an_error_naming_the_points(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RTP_FAULT", "kill@save.comit")
    with pytest.raises(hf_rtp.SettingError, match=r"names no fault point 'save.comit'; the points are .*save.commit,"):
        hf_rtp.from_pretrained(str(tmp_path / "checked-before-it-is-read"))


@pytest.mark.parametrize("kind", ["not json", "fifo", "folder"])
def test_a_broken_generation_config_warns_and_loads_as_vanilla_does(tmp_path, caplog, kind):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    path = os.path.join(ckpt, "generation_config.json")
    os.remove(path)
    if kind == "not json":
        with open(path, "w") as f:
            f.write("{not json")
    elif kind == "fifo":
        os.mkfifo(path)  # opening it to read would block forever
    else:
        os.mkdir(path)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt)
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        ours = hf_rtp.from_pretrained(ckpt)
    assert f"ignoring {path}" in caplog.text
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_length", "do_sample", "num_beams"):
        assert getattr(ours.generation_config, key) == getattr(vanilla.generation_config, key), key
    batch = torch.arange(10).reshape(1, 10)
    assert torch.equal(
        ours.generate(batch, max_new_tokens=3, do_sample=False),
        vanilla.generate(batch, max_new_tokens=3, do_sample=False),
    )


def test_an_index_bigger_than_any_real_one_is_refused_unread(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt", max_shard_size="12KB")
    index = os.path.join(ckpt, "model.safetensors.index.json")
    with open(index, "r+") as f:
        f.seek(0, os.SEEK_END)
        f.write(" " * (65 << 20))
    with pytest.raises(hf_rtp.CheckpointError, match=r"safetensors index.*more than the"):
        hf_rtp.from_pretrained(ckpt)


def test_the_bounds_leave_real_files_alone(tmp_path):
    """A file of many small tensors, as per-expert MoE checkpoints have, parses as before."""
    path = str(tmp_path / "many.safetensors")
    save_file({f"experts.{i}.w": torch.zeros(2) for i in range(20_000)}, path, metadata={"format": "pt"})
    assert len(read_header(path)) == 20_000
