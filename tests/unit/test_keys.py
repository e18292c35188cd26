"""hf_rtp/checkpoint/keys.py at world size 1 (one process, no process group): which stored tensors each
parameter of an empty model reads, and the ties a checkpoint stores apart, on tiny checkpoints vanilla saved."""

import logging
import os

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file
from support.models import make_tiny, make_tiny_llama, rewrite_names, tiny_config
from transformers import AutoModelForCausalLM

from hf_rtp import plans
from hf_rtp.checkpoint.conversion import Transposed
from hf_rtp.checkpoint.keys import untie_stored_apart, wants_for
from hf_rtp.checkpoint.safetensors_io import read_header
from hf_rtp.distributed.ranks.topology import setup
from hf_rtp.model.ties import tie_targets
from hf_rtp.settings import Settings

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def one():
    """A ring of one: the topology from_pretrained starts in a single process."""
    topology = setup(Settings.resolve())
    assert topology.world_size == topology.rtp_size == 1 and topology.control is None
    return topology


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("untied") / "ckpt")


def _empty(arch, tied=False):
    """The model as the loader's build step makes it: parameters on meta, before any read."""
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(tiny_config(arch, tied), dtype=torch.float32)


def _entries(folder):
    return read_header(os.path.join(folder, "model.safetensors"))


def test_each_parameter_reads_its_own_stored_name_whole_at_world_size_1(untied, one):
    model = _empty("llama")
    resolution = plans.get("llama").resolve(model)
    entries = _entries(untied)
    wants, sources = wants_for(model, resolution, one, entries)
    params = dict(model.named_parameters())
    assert set(wants) == set(params) == set(entries)
    assert {HEAD, EMBED, "model.layers.0.self_attn.q_proj.weight"} <= resolution.rotated_params
    for name, want in wants.items():
        assert want.source.names == [name], name
        assert want.rows is None, name  # rotated or not: a ring of one reads every row
        assert (want.shape, want.dtype) == (params[name].shape, torch.float32), name
    assert sources == {name: want.source for name, want in wants.items()}
    stored = load_file(os.path.join(untied, "model.safetensors"))
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(wants[down].source.read(entries, wants[down].rows), stored[down])


def test_a_tied_head_is_not_read_its_embedding_is(tmp_path, one):
    folder = make_tiny_llama(tmp_path / "tied", tied=True)
    entries = _entries(folder)
    assert HEAD not in entries  # vanilla stores a tie once
    model = _empty("llama", tied=True)
    wants, _ = wants_for(model, plans.get("llama").resolve(model), one, entries)
    assert HEAD not in wants and wants[EMBED].source.names == [EMBED]
    assert set(wants) == set(entries)


def test_gpt2s_original_names_are_read_for_transformers_names(tmp_path, one):
    folder = make_tiny("gpt2", tmp_path / "gpt2")
    rewrite_names(folder, lambda name: name.removeprefix("transformer."))  # as the Hub's gpt2 stores them
    model = _empty("gpt2")
    wants, _ = wants_for(model, plans.get("gpt2").resolve(model), one, _entries(folder))
    assert HEAD not in wants  # GPT-2 ties its head to wte
    assert wants["transformer.wte.weight"].source.names == ["wte.weight"]
    assert wants["transformer.h.1.attn.c_attn.weight"].source.names == ["h.1.attn.c_attn.weight"]
    assert wants["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: [in, out], as stored


def test_a_name_the_checkpoint_lacks_reads_under_its_own_name_to_be_reported_missing(untied, one):
    entries = {name: entry for name, entry in _entries(untied).items() if name != "model.norm.weight"}
    model = _empty("llama")
    wants, _ = wants_for(model, plans.get("llama").resolve(model), one, entries)
    assert wants["model.norm.weight"].source.names == ["model.norm.weight"]


def test_a_weight_marked_transposed_reads_the_stored_tensor_transposed(untied, one):
    model = _empty("llama")
    resolution = plans.get("llama").resolve(model)
    name = "model.layers.0.mlp.up_proj.weight"
    resolution.transposed.add(name)  # as bitsandbytes' select marks a GPT-2 Conv1D it quantizes as a linear
    entries = _entries(untied)
    wants, _ = wants_for(model, resolution, one, entries)
    assert isinstance(wants[name].source, Transposed) and wants[name].source.names == [name]
    stored = load_file(os.path.join(untied, "model.safetensors"))[name]
    assert torch.equal(wants[name].source.read(entries, None), stored.t())
    assert torch.equal(wants[name].source.read(entries, (3, 7)), stored.t()[3:7])


def _tied_checkpoint_storing(folder, tmp_path, head):
    """`folder`'s tensors with the head `head(embedding)`, as a tied model's checkpoint that stores both."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors[HEAD] = head(tensors[EMBED])
    out = tmp_path / "both"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return _entries(str(out))


def test_a_tie_stored_apart_with_other_values_is_untied_as_vanilla_does(untied, one, caplog):
    model = _empty("llama", tied=True)
    assert tie_targets(model) == {HEAD: EMBED}  # an empty model's ties are names: its meta parameters are apart
    head = model.lm_head.weight
    entries = _entries(untied)  # a head and an embedding of their own values, under a config that says tied
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        assert untie_stored_apart(model, entries, one) == [HEAD]
    assert "specifies to tie model.embed_tokens.weight to lm_head.weight, but both are present" in caplog.text
    assert tie_targets(model) == {} and HEAD not in model.all_tied_weights_keys
    assert model.lm_head.weight is not head  # a parameter of its own, empty until the read fills it
    assert model.lm_head.weight.is_meta and model.lm_head.weight.shape == head.shape
    wants, _ = wants_for(model, plans.get("llama").resolve(model), one, entries)
    assert wants[HEAD].source.names == [HEAD]  # now read from its own tensor


@pytest.mark.parametrize("stored", ["same values", "head not stored"])
def test_a_tie_stored_once_or_twice_alike_stays_tied(untied, tmp_path, one, stored, caplog):
    if stored == "same values":
        entries = _tied_checkpoint_storing(untied, tmp_path, lambda embed: embed.clone())
    else:
        entries = {name: entry for name, entry in _entries(untied).items() if name != HEAD}
    model = _empty("llama", tied=True)
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        assert untie_stored_apart(model, entries, one) == []
    assert tie_targets(model) == {HEAD: EMBED}
    assert "NOT tie" not in caplog.text


def test_one_differing_element_unties(untied, tmp_path, one):
    def nudged(embed):
        head = embed.clone()
        head[-1, -1] += 1.0
        return head

    model = _empty("llama", tied=True)
    assert untie_stored_apart(model, _tied_checkpoint_storing(untied, tmp_path, nudged), one) == [HEAD]
