import logging

import pytest
import torch
from accelerate import init_empty_weights
from support.models import tiny_llama_config
from support.zoo import zoo_config
from torch import nn
from transformers import AutoModelForCausalLM

from hf_rtp import plans
from hf_rtp.plans import Plan, PlanError
from hf_rtp.plans.auto import auto_plan


def _empty_llama(**overrides):
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(tiny_llama_config(**overrides))


def test_llama_plan_covers_every_parameter():
    model = _empty_llama(num_hidden_layers=3)
    resolution = plans.get("llama").resolve(model)
    assert len(resolution.rotated) == 3 * 7 + 2
    assert resolution.rotated["model.embed_tokens"] == "embedding"
    assert resolution.rotated["lm_head"] == "linear"
    assert sorted(resolution.replicated)[-1] == "model.norm.weight"
    assert len(resolution.replicated) == 2 * 3 + 1


def test_llama_plan_takes_biases_along():
    model = _empty_llama(attention_bias=True, mlp_bias=True)
    resolution = plans.get("llama").resolve(model)
    assert "model.layers.0.self_attn.q_proj" in resolution.rotated  # its bias is covered with it


def test_uncovered_parameter_is_named():
    llama = plans.get("llama")
    rotate = {k: v for k, v in llama.rotate.items() if k != "lm_head"}
    plan = Plan(name="partial", rotate=rotate, replicate=llama.replicate)
    with pytest.raises(
        PlanError,
        match=r"plan 'partial' covers neither rotation nor replication for 1 parameter\(s\): lm_head.weight\.",
    ):
        plan.resolve(_empty_llama())


def test_parameter_both_rotated_and_replicated_is_an_error():
    plan = Plan(rotate={"lm_head": "linear"}, replicate=("lm_head.weight",))
    with pytest.raises(PlanError, match=r"both rotated and replicated: lm_head.weight"):
        plan.resolve(_empty_llama())


def test_kind_must_fit_module_type():
    with pytest.raises(
        PlanError, match=r"model.norm is a LlamaRMSNorm, but kind 'linear' rotates nn.Linear modules only when"
    ):
        Plan(rotate={"model.norm": "linear"}).resolve(_empty_llama())
    with pytest.raises(PlanError, match="unknown layer kind 'conv'"):
        Plan(rotate={"lm_head": "conv"}).resolve(_empty_llama())


def test_unknown_model_type_lists_supported():
    with pytest.raises(
        plans.UnsupportedModelError,
        match=r"no plan for model_type 'bert'. Supported: deepseek_v3, gemma, gemma2, gemma3_text, gpt2, gpt_oss, "
        r"llama, mistral, mixtral, phi3, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, qwen3, qwen3_moe.*plan='auto'",
    ):
        plans.get("bert")


class _ScaledLinear(nn.Linear):
    """A Linear subclass with math of its own: rotating it as a plain Linear would drop the scale."""

    def forward(self, x):
        return super().forward(x) * 2


def _with_scaled_down_proj(model):
    old = model.model.layers[0].mlp.down_proj
    with init_empty_weights():
        model.model.layers[0].mlp.down_proj = _ScaledLinear(old.in_features, old.out_features, bias=False)
    return model


def test_a_linear_subclass_with_its_own_forward_is_refused_by_name():
    model = _with_scaled_down_proj(_empty_llama())
    with pytest.raises(
        PlanError,
        match=r"model.layers.0.mlp.down_proj is a _ScaledLinear, .* _ScaledLinear overrides "
        r"Linear.forward",
    ):
        plans.get("llama").resolve(model)


def test_auto_keeps_such_a_module_whole_and_says_why(caplog):
    model = _with_scaled_down_proj(_empty_llama())
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        resolution = auto_plan(model).resolve(model)
    assert "model.layers.0.mlp.down_proj" not in resolution.rotated
    assert "model.layers.0.mlp.down_proj.weight" in resolution.replicated
    assert "model.layers.1.mlp.down_proj" in resolution.rotated
    assert (
        "kept whole because no layer kind reproduces them exactly: model.layers.0.mlp.down_proj (_ScaledLinear "
        "overrides Linear.forward" in caplog.text
    )


def test_gemmas_scaled_embedding_is_adapted_and_an_edited_copy_refused():
    model = _empty(zoo_config("gemma"))
    assert plans.get("gemma").resolve(model).rotated["model.embed_tokens"] == "embedding"
    source = type(model.model.embed_tokens)

    class Edited(source):  # same name of the buffer, other math
        def forward(self, input_ids):
            return super(source, self).forward(input_ids) * self.embed_scale.to(self.weight.dtype) + 1

    model.model.embed_tokens.__class__ = Edited
    with pytest.raises(PlanError, match=r"model.embed_tokens is a Edited, .*Edited overrides nn.Embedding.forward"):
        plans.get("gemma").resolve(model)


def test_auto_shards_every_experts_layout_and_keeps_routers_whole():
    for name, biases in (("qwen2_moe", False), ("deepseek_v3", False), ("gpt_oss", True)):
        model = _empty(zoo_config(name))
        resolution = auto_plan(model).resolve(model)
        experts = [m for m, kind in resolution.rotated.items() if kind == "experts"]
        assert experts and all(m.endswith("mlp.experts") for m in experts), name
        assert any(n.endswith("experts.gate_up_proj_bias") for n in resolution.rotated_params) == biases, name
        assert all(("gate" in n or "router" in n) for n in resolution.replicated if ".mlp." in n), name
        if name == "qwen2_moe":
            assert "model.layers.0.mlp.shared_expert.up_proj" in resolution.rotated
        registered = plans.get(name).resolve(model)
        # the registered plan shards alike, but keeps Qwen-MoE's one-output shared-expert gate whole
        assert registered.rotated_params == {n for n in resolution.rotated_params if "shared_expert_gate" not in n}


def test_experts_declared_otherwise_are_refused():
    model = _empty(zoo_config("qwen2_moe"))
    model.model.layers[0].mlp.experts.has_post_expert_norm = True
    with pytest.raises(PlanError, match=r"mlp.experts is a Qwen2MoeExperts, .*post-expert norm"):
        plans.get("qwen2_moe").resolve(model)


def _empty(config):
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_auto_plan_warns_apart_when_most_parameters_stay_whole(caplog):
    from transformers.models.falcon.modeling_falcon import FalconLinear

    with init_empty_weights():
        falcon = AutoModelForCausalLM.from_config(zoo_config("falcon"))
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        plan = auto_plan(falcon)  # FalconLinear's forward is a plain linear written out: rotated
    assert "transformer.h.0.mlp.dense_h_to_4h" in plan.rotate and not any(
        "whole on every rank" in r.message for r in caplog.records
    )
    for name, module in list(falcon.named_modules()):
        if isinstance(module, FalconLinear):
            falcon.set_submodule(
                name, _ScaledLinear(module.in_features, module.out_features, bias=False, device="meta")
            )
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        plan = auto_plan(falcon)
    (record,) = [r for r in caplog.records if "whole on every rank" in r.message]
    assert "transformer.h.0.mlp.dense_h_to_4h" not in plan.rotate
    assert "keeps 77% of FalconForCausalLM's parameters whole on every rank" in record.message, record.message
    assert "transformer.h.0.mlp.dense_h_to_4h.weight" in record.message


def test_the_vision_language_plans_cover_qwen2_5_vl_as_they_cover_qwen2_vl():
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=32),
    )
    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(config)
    resolution = plans.get("qwen2_5_vl").resolve(model)  # every parameter covered exactly once
    assert "model.language_model.layers.1.self_attn.o_proj" in resolution.rotated and "lm_head" in resolution.rotated
    assert not any(name.startswith("model.visual.") for name in resolution.rotated)
