import pytest
from accelerate import init_empty_weights
from support.models import tiny_llama_config
from transformers import AutoModelForCausalLM

from hf_rtp import plans
from hf_rtp.plans import Plan, PlanError


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
    with pytest.raises(PlanError, match=r"plan 'partial' covers neither rotation nor replication for 1 parameter\(s\): lm_head.weight\."):
        plan.resolve(_empty_llama())


def test_parameter_both_rotated_and_replicated_is_an_error():
    plan = Plan(rotate={"lm_head": "linear"}, replicate=("lm_head.weight",))
    with pytest.raises(PlanError, match="both rotated and replicated: lm_head.weight"):
        plan.resolve(_empty_llama())


def test_kind_must_fit_module_type():
    with pytest.raises(PlanError, match="model.norm is a LlamaRMSNorm, but kind 'linear' rotates nn.Linear modules"):
        Plan(rotate={"model.norm": "linear"}).resolve(_empty_llama())
    with pytest.raises(PlanError, match="unknown layer kind 'conv'"):
        Plan(rotate={"lm_head": "conv"}).resolve(_empty_llama())


def test_unknown_model_type_lists_supported():
    with pytest.raises(
        plans.UnsupportedModelError, match=r"no plan for model_type 'bert'. Supported: gpt2, llama, mixtral.*plan='auto'"
    ):
        plans.get("bert")
