"""Stored names map to parameters as transformers' conversion mapping maps them, read by rows."""

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from support.models import tiny_config
from support.zoo import zoo_config
from transformers import AutoModelForCausalLM

from hf_rtp.checkpoint.conversion import stored_sources
from hf_rtp.checkpoint.safetensors_io import read_header
from hf_rtp.errors import CheckpointError


def _empty(config):
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def _stored(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "x.safetensors"))
    return read_header(str(tmp_path / "x.safetensors"))


def test_per_expert_tensors_read_as_this_ranks_fused_rows(tmp_path):
    model = _empty(tiny_config("mixtral", num_hidden_layers=1))  # 5 experts, intermediate 24, hidden 32
    w1, w3 = [torch.randn(24, 32) for _ in range(5)], [torch.randn(24, 32) for _ in range(5)]
    stem = "model.layers.0.block_sparse_moe.experts"
    entries = _stored(
        tmp_path,
        {**{f"{stem}.{e}.w1.weight": w1[e] for e in range(5)}, **{f"{stem}.{e}.w3.weight": w3[e] for e in range(5)}},
    )
    source = stored_sources(model, list(entries))["model.layers.0.mlp.experts.gate_up_proj"]
    fused = torch.stack([torch.cat([w1[e], w3[e]]) for e in range(5)])
    assert torch.equal(source.read(entries, (1, 3)), fused[1:3])  # reads experts 1 and 2 only
    assert source.read(entries, (5, 5)).shape == (0, 48, 32)
    parts = list(source.stored_parts(fused.shape))
    assert parts[3] == (f"{stem}.1.w3.weight", torch.Size([24, 32]), (1, 2), slice(24, 48))


def test_ten_or_more_experts_are_stacked_in_number_order(tmp_path):
    config = zoo_config("qwen2_moe")
    config.num_experts = 11
    model = _empty(config)
    stem = "model.layers.0.mlp.experts"
    down = {f"{stem}.{e}.down_proj.weight": torch.full((32, 24), float(e)) for e in range(11)}
    entries = _stored(tmp_path, down)
    source = stored_sources(model, list(entries))[f"{stem}.down_proj"]
    assert source.read(entries, None)[:, 0, 0].tolist() == [float(e) for e in range(11)]  # not 0, 1, 10, 2, ...


def test_a_wrong_number_of_stored_experts_is_named(tmp_path):
    model = _empty(tiny_config("mixtral", num_hidden_layers=1))
    entries = _stored(
        tmp_path, {f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight": torch.zeros(32, 24) for e in range(4)}
    )
    with pytest.raises(CheckpointError, match=r"down_proj has 5 experts, but the checkpoint stores .*: 4\)"):
        stored_sources(model, list(entries))


def test_renames_and_prefixes_and_what_saving_writes(tmp_path):
    neox = _empty(zoo_config("gpt_neox"))
    entries = _stored(tmp_path, {"embed_out.weight": torch.zeros(101, 32)})
    source = stored_sources(neox, list(entries))["lm_head.weight"]
    assert source.names == ["embed_out.weight"]
    assert [part[0] for part in source.stored_parts(torch.Size([101, 32]))] == ["embed_out.weight"]  # as vanilla

    gpt2 = _empty(tiny_config("gpt2"))  # openai-community/gpt2 stores no "transformer." prefix
    entries = _stored(tmp_path, {"h.0.attn.c_attn.weight": torch.zeros(32, 96), "wte.weight": torch.zeros(101, 32)})
    sources = stored_sources(gpt2, list(entries))
    assert sources["transformer.h.0.attn.c_attn.weight"].names == ["h.0.attn.c_attn.weight"]
    # vanilla save_pretrained writes the model's own names back, prefix included
    assert next(sources["transformer.wte.weight"].stored_parts(torch.Size([101, 32])))[0] == "transformer.wte.weight"


def test_a_transposed_weight_reads_this_ranks_columns_as_rows_band_by_band(tmp_path, monkeypatch):
    """A GPT-2 Conv1D weight [in, out] quantized as vanilla's bitsandbytes does: rows of its transpose, read from
    bands of stored rows; a band smaller than the tensor (here 3 rows of 7) cuts the read into pieces."""
    from hf_rtp.checkpoint.conversion import Transposed

    weight = torch.randn(7, 10)
    entries = _stored(tmp_path, {"c_fc.weight": weight})
    monkeypatch.setattr(Transposed, "BAND_BYTES", 3 * 10 * 4)
    source = Transposed([("c_fc.weight", torch.Size((7, 10)))])
    for rows in ((0, 4), (4, 7), (7, 10), None):
        expected = weight.t()[slice(*rows)] if rows else weight.t()
        assert torch.equal(source.read(entries, rows), expected), rows
    with pytest.raises(CheckpointError, match="read transposed"):
        list(source.stored_parts(torch.Size((10, 7))))
