"""Every keyword transformers' from_pretrained takes is honoured by hf_rtp.from_pretrained with vanilla's
meaning (the same model as vanilla's call, loaded beside it) or refused by name; none is silently ignored.

In one process: what a keyword means does not depend on the world size, and the rotated loading path
itself is compared with vanilla at 2 and 3 ranks elsewhere (test_equivalence).
"""

import inspect
import json
import os
import re

import pytest
import torch
import transformers
from support.models import make_tiny_llama
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

import hf_rtp
from hf_rtp import keywords


def vanilla_keywords() -> set[str]:
    """The keywords of transformers' from_pretrained: its signature, and every name its body pops from kwargs."""
    method = transformers.PreTrainedModel.from_pretrained
    signature = inspect.signature(method)
    named = {p.name for p in signature.parameters.values() if p.kind == p.KEYWORD_ONLY}
    named |= {
        p.name
        for p in signature.parameters.values()
        if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("cls", "pretrained_model_name_or_path")
    }
    source = inspect.getsource(method)
    popped = set(re.findall(r"kwargs\.pop\(\s*\"(\w+)\"", source))
    dropped = re.search(r"for name in \[([^\]]*)\]:\s*\n\s*_ = kwargs\.pop\(name", source)
    assert dropped is not None, "vanilla's list of dropped keywords moved: update this test"
    return named | popped | set(re.findall(r"\"(\w+)\"", dropped.group(1)))


def test_every_vanilla_keyword_is_decided():
    decided = set(keywords.HONOURED) | set(keywords.REFUSED) | set(keywords.NO_OPS) | set(keywords.NO_OPS_INTERNAL)
    seen = vanilla_keywords()
    assert len(seen) > 40  # the walk found vanilla's keywords, not an empty set
    assert seen - decided == set(), "transformers takes keywords hf_rtp neither honours nor refuses"
    assert not set(keywords.HONOURED) & set(keywords.REFUSED)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("keywords") / "ckpt")


SAMPLES = {"device_map": "auto", "offload_buffers": True, "adapter_name": "other"}
SAMPLES.update({"force_download": True, "ignore_mismatched_sizes": True, "use_kernels": True})
SAMPLES.update({"allow_all_kernels": True})


@pytest.mark.parametrize("name", sorted(keywords.REFUSED))
def test_a_refused_keyword_is_named_with_its_reason(ckpt, name):
    # hf_rtp's own class, and a TypeError as transformers raises for a keyword it does not take
    with pytest.raises(hf_rtp.KeywordError, match=rf"does not take {name}=: .{{20}}") as refused:
        hf_rtp.from_pretrained(ckpt, **{name: SAMPLES.get(name, "x")})
    assert isinstance(refused.value, TypeError)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device_map": "auto"}, "device_map='auto'"),
        ({"device_map": "balanced"}, "device_map='balanced'"),
        ({"device_map": {"model.embed_tokens": "cpu", "lm_head": "cpu"}}, "device_map={'model.embed_tokens'"),
        ({"use_safetensors": False}, "use_safetensors=False"),
        ({"weights_only": False}, "weights_only=False"),
        ({"device": "cpu", "device_map": {"": "meta"}}, "different devices"),
        ({"config": AutoConfig.for_model("llama"), "attn_implementation": "eager"}, "config overrides"),
    ],
)
def test_values_hf_rtp_cannot_honour_are_refused_by_name(ckpt, kwargs, named):
    with pytest.raises(hf_rtp.KeywordError, match=re.escape(named)) as refused:
        hf_rtp.from_pretrained(ckpt, **kwargs)
    assert isinstance(refused.value, TypeError)


def _same_weights(model, vanilla):
    ours, theirs = model.state_dict(), vanilla.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"use_safetensors": True, "low_cpu_mem_usage": True, "weights_only": True, "disable_mmap": True},
        {"torch_dtype": torch.float64},
        {"dtype": torch.bfloat16, "torch_dtype": torch.float64},  # dtype wins, as in vanilla
        {"dtype": None},  # what transformers' example scripts pass by default: vanilla's "auto"
        {"dtype": None, "torch_dtype": torch.float64},
        {"dtype": "auto", "torch_dtype": torch.float64},  # vanilla: "auto" is a dtype given, and wins
        {"dtype": {"": torch.float64}},  # transformers 5's per-sub-config dict: its "" entry for every module
        {"dtype": {"": "bfloat16", "text_config": "float64"}},
        {"dtype": {"text_config": torch.float64}},  # no "" entry: torch's default dtype
        {"trust_remote_code": True},  # a built-in architecture: transformers' own class, as in vanilla
        {"device_map": {"": "cpu"}},
        {"device_map": "cpu"},
        {"attn_implementation": "eager"},
        {"generation_config": GenerationConfig(max_new_tokens=3, do_sample=False)},
        {"from_tf": False, "_fast_init": True, "mirror": None},  # vanilla drops these itself
    ],
    ids=repr,
)
def test_honoured_keywords_load_what_vanilla_loads(ckpt, kwargs):
    model = hf_rtp.from_pretrained(ckpt, **kwargs)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, **kwargs)
    _same_weights(model, vanilla)
    assert model.config._attn_implementation == vanilla.config._attn_implementation
    assert model.generation_config.to_dict() == vanilla.generation_config.to_dict()
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


@pytest.mark.parametrize("mapped", ["AutoConfig", "AutoModelForCausalLM"])
def test_trust_remote_code_is_refused_by_name_where_vanilla_would_run_the_checkpoints_code(tmp_path, ckpt, mapped):
    folder = tmp_path / "remote"
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {mapped: f"modeling_custom.{mapped.removeprefix('Auto')}"}
    (folder / "config.json").write_text(json.dumps(config))
    refusal = rf"trust_remote_code=True.*maps {mapped} to the repository's own code"
    with pytest.raises(hf_rtp.KeywordError, match=refusal):
        hf_rtp.from_pretrained(folder, trust_remote_code=True)
    _same_weights(hf_rtp.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder))  # vanilla's class


def test_bad_dtypes_are_refused_by_name_as_value_errors(ckpt):
    for dtype, named in (("floaty", "dtype must be 'auto'"), ({"": "auto"}, "its '' entry"), (3, "got int")):
        with pytest.raises(hf_rtp.SettingError, match=re.escape(named)) as refused:
            hf_rtp.from_pretrained(ckpt, dtype=dtype)
        assert isinstance(refused.value, ValueError)


def test_subfolder_reads_config_and_weights_from_the_subfolder(tmp_path):
    root = make_tiny_llama(tmp_path / "repo", seed=1)  # another model at the top: the silent mix
    make_tiny_llama(tmp_path / "repo" / "sub", seed=2, hidden_size=32)
    model = hf_rtp.from_pretrained(root, subfolder="sub")
    vanilla = AutoModelForCausalLM.from_pretrained(root, subfolder="sub")
    assert model.config.hidden_size == 32
    _same_weights(model, vanilla)


@pytest.mark.parametrize("max_shard_size", ["50GB", "20KB"], ids=["one-file", "sharded"])
def test_variant_reads_the_variant_files(tmp_path, ckpt, max_shard_size):
    folder = tmp_path / "variants"
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(folder)  # the plain files, beside
    variant = AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        variant.lm_head.weight.add_(1.0)  # the variant differs: reading the plain files would show
    variant.save_pretrained(folder, variant="ft", max_shard_size=max_shard_size)
    model = hf_rtp.from_pretrained(folder, variant="ft")
    _same_weights(model, AutoModelForCausalLM.from_pretrained(folder, variant="ft"))
    assert not torch.equal(model.lm_head.weight, hf_rtp.from_pretrained(folder).lm_head.weight)


def test_config_object_and_config_path_are_used_as_vanilla_uses_them(tmp_path, ckpt):
    config = AutoConfig.from_pretrained(ckpt)
    config.rms_norm_eps = 0.25
    config.save_pretrained(tmp_path / "other-config")
    for passed in (config, str(tmp_path / "other-config")):
        model = hf_rtp.from_pretrained(ckpt, config=passed)
        # PreTrainedModel's meaning; the Auto classes read a config *path* from the checkpoint instead
        vanilla = type(model).from_pretrained(ckpt, config=passed)
        assert model.config.rms_norm_eps == vanilla.config.rms_norm_eps == 0.25
        _same_weights(model, vanilla)
        ids = torch.tensor([[1, 5, 9, 3]])
        torch.testing.assert_close(model(ids).logits, vanilla(ids).logits, rtol=0, atol=0)
    assert config.rms_norm_eps == 0.25 and model.config is not config  # a copy, as vanilla takes


def test_output_loading_info_is_vanillas_pair(ckpt):
    for auto, ours in ((AutoModelForCausalLM, hf_rtp.AutoModelForCausalLM), (AutoModelForSequenceClassification, None)):
        _, expected = auto.from_pretrained(ckpt, output_loading_info=True, num_labels=2)
        if ours is None:
            _, info = hf_rtp.from_pretrained(ckpt, auto_class=auto, output_loading_info=True, num_labels=2)
        else:
            _, info = ours.from_pretrained(ckpt, output_loading_info=True, num_labels=2)
        assert info == expected, auto.__name__  # the classifier head a causal LM lacks is missing in both
    assert expected["missing_keys"] == {"score.weight"}


def test_a_folder_with_an_adapter_beside_the_base_is_refused_not_loaded_without_it(tmp_path, ckpt):
    from peft import LoraConfig, get_peft_model

    folder = tmp_path / "with-adapter"
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(folder)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt), LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(folder)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
    vanilla = AutoModelForCausalLM.from_pretrained(folder)
    assert any("lora_A" in n for n, _ in vanilla.named_parameters())  # vanilla applies the adapter
    with pytest.raises(hf_rtp.CheckpointError, match=r"adapter_config\.json.*does not apply adapters"):
        hf_rtp.from_pretrained(folder)
    os.remove(folder / "config.json")  # an adapter-only folder: vanilla would load its base
    with pytest.raises(hf_rtp.CheckpointError, match="PEFT adapter only"):
        hf_rtp.from_pretrained(folder)
