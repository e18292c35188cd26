"""Buffers a checkpoint stores (persistent ones: DeepSeek-V3's routing correction bias; integer tables such as
DeepSeek-V4's token-to-expert map) load as vanilla loads them, and a Trainer's reload of a checkpoint into the
model (best model, a weights-only resume: `load_into`) overwrites them too."""

import os

import torch
from support.models import make_tiny
from support.spawn import run_on_ranks
from support.zoo import make_zoo_checkpoint


def _with_a_table(cls):
    """`cls` (a decoder layer) with a persistent integer buffer of its own, as a family with a lookup table has."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_buffer("table", torch.zeros(4, dtype=torch.long))

    cls.__init__ = __init__


def _loads(deepseek, llama, out):
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    import hf_rtp
    from hf_rtp.checkpoint.load import load_into

    said = {}
    model = hf_rtp.from_pretrained(deepseek, dtype=torch.float32)
    vanilla = AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.float32)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    said["bias"] = torch.equal(model.get_buffer(bias), vanilla.get_buffer(bias))
    model.get_buffer(bias).zero_()
    load_into(model, deepseek)  # Trainer's load_best_model_at_end and weights-only resume
    said["bias reloaded"] = torch.equal(model.get_buffer(bias), vanilla.get_buffer(bias))

    _with_a_table(modeling_llama.LlamaDecoderLayer)
    if int(os.environ["RANK"]) == 0:
        source = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
        source.model.layers[0].table.copy_(torch.tensor([3, 1, 4, 1]))
        source.save_pretrained(out)
    torch.distributed.barrier()
    model = hf_rtp.from_pretrained(out, dtype=torch.float32)
    table = model.model.layers[0].table
    said["table"] = (table.dtype, table.tolist())
    return said


def test_stored_buffers_load_and_reload_as_vanilla(tmp_path):
    deepseek = make_zoo_checkpoint("deepseek_v3", tmp_path / "deepseek")  # its bias set apart from zeros
    llama = make_tiny("llama", tmp_path / "llama")
    for said in run_on_ranks(_loads, 2, deepseek, llama, str(tmp_path / "with-table")):
        assert said["bias"] and said["bias reloaded"], said
        assert said["table"] == (torch.long, [3, 1, 4, 1]), said
