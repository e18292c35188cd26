import torch
from safetensors.torch import save_file

from hf_rtp.checkpoint.formats import PerExpert, Renamed, source_for
from hf_rtp.checkpoint.safetensors_io import read_header

EXPERTS = ".block_sparse_moe.experts.{expert}"
MIXTRAL = (
    PerExpert(".mlp.experts.gate_up_proj", (f"{EXPERTS}.w1.weight", f"{EXPERTS}.w3.weight")),
    Renamed(".mlp.gate.", ".block_sparse_moe.gate."),
)


def test_per_expert_tensors_read_as_this_ranks_fused_rows(tmp_path):
    w1 = [torch.randn(4, 6) for _ in range(5)]
    w3 = [torch.randn(4, 6) for _ in range(5)]
    stored = {f"m.l.block_sparse_moe.experts.{e}.w1.weight": w1[e] for e in range(5)}
    stored |= {f"m.l.block_sparse_moe.experts.{e}.w3.weight": w3[e] for e in range(5)}
    save_file(stored, str(tmp_path / "x.safetensors"))
    entries = read_header(str(tmp_path / "x.safetensors"))
    source = source_for("m.l.mlp.experts.gate_up_proj", torch.Size([5, 8, 6]), MIXTRAL)
    fused = torch.stack([torch.cat([w1[e], w3[e]]) for e in range(5)])
    assert torch.equal(source.read(entries, (1, 3)), fused[1:3])  # reads experts 1 and 2 only
    assert source.read(entries, (5, 5)).shape == (0, 8, 6)
    parts = list(source.stored_parts(fused.shape))
    assert parts[3] == ("m.l.block_sparse_moe.experts.1.w3.weight", torch.Size([4, 6]), (1, 2), slice(4, 8))


def test_renames_and_the_models_own_names():
    assert source_for("m.l.mlp.gate.weight", torch.Size([5, 6]), MIXTRAL).names == ["m.l.block_sparse_moe.gate.weight"]
    assert source_for("m.l.self_attn.q_proj.weight", torch.Size([6, 6]), MIXTRAL).names == ["m.l.self_attn.q_proj.weight"]
    prefix = (Renamed("transformer.", "", prefix=True),)
    assert source_for("transformer.h.0.attn.c_attn.weight", torch.Size([2]), prefix).names == ["h.0.attn.c_attn.weight"]
    assert source_for("lm_head.weight", torch.Size([2]), prefix).names == ["lm_head.weight"]
