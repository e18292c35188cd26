"""User plans (register, plan=), the automatic plan's log, and every way a plan can be wrong."""

import logging

import pytest
import torch
from support.models import global_batch, make_tiny, tiny_config
from support.spawn import run_on_ranks
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_rtp
from hf_rtp import plans
from hf_rtp.plans import Plan, PlanError

QWEN2 = Plan(
    name="my-qwen2",
    rotate={
        "model.embed_tokens": "embedding",
        "model.layers.*.self_attn.[qkvo]_proj": "linear",
        "model.layers.*.mlp.*_proj": "linear",
        "lm_head": "linear",
    },
    replicate=("model.layers.*_layernorm.weight", "model.norm.weight"),
)


@pytest.fixture
def registry():
    saved = dict(plans._REGISTRY)
    yield
    plans._REGISTRY.clear()
    plans._REGISTRY.update(saved)


def _load_registered(ckpt):
    # each process registers, as a user's script would; replacing the built-in plan takes overwrite=True
    plans.register("qwen2", QWEN2, overwrite=True)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    rank = torch.distributed.get_rank()
    batch = global_batch(2)[rank]
    torch.testing.assert_close(model(input_ids=batch).logits, ref(input_ids=batch).logits, atol=1e-5, rtol=1e-5)
    q = model.model.layers[0].self_attn.q_proj
    return (
        hf_rtp.state_of(model).plan.name,
        isinstance(q.weight, DTensor),
        isinstance(q.bias, DTensor),
        q.weight.to_local().shape[0],
    )


def test_registered_user_plan_is_used_for_its_model_type(tmp_path):
    ckpt = make_tiny("qwen2", tmp_path / "ckpt")
    results = run_on_ranks(_load_registered, 2, ckpt)
    assert results == [("my-qwen2", True, True, 16)] * 2  # q_proj's bias travels with its rows


def test_register_refuses_silent_replacement(registry):
    with pytest.raises(PlanError, match="a plan for 'qwen2' is registered already; pass overwrite=True"):
        plans.register("qwen2", QWEN2)  # the built-in one
    plans.register("starcoder2", QWEN2)
    with pytest.raises(PlanError, match="registered already; pass overwrite=True"):
        plans.register("starcoder2", QWEN2)
    plans.register("starcoder2", QWEN2, overwrite=True)
    with pytest.raises(TypeError, match=r"needs an hf_rtp.plans.Plan"):
        plans.register("starcoder2", {"rotate": {}})


def _override_keeps_lm_head_whole(ckpt):
    llama = plans.get("llama")
    rotate = {k: v for k, v in llama.rotate.items() if k != "lm_head"}
    plan = Plan(name="head-whole", rotate=rotate, replicate=(*llama.replicate, "lm_head.weight"))
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, plan=plan)
    return type(model.lm_head.weight).__name__, type(model.model.embed_tokens.weight).__name__


def test_plan_argument_overrides_the_registry(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_override_keeps_lm_head_whole, 2, ckpt) == [("Parameter", "RotatedTensor")] * 2


def test_auto_plan_logs_what_it_rotates(tmp_path, caplog):
    ckpt = make_tiny("qwen2", tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        hf_rtp.from_pretrained(ckpt, plan="auto")
    (record,) = [r for r in caplog.records if "plan='auto'" in r.message]
    assert "rotating 16 modules (1 embedding, 15 linear)" in record.message
    assert "model.layers.1.mlp.down_proj" in record.message and "lm_head" in record.message
    assert "replicating 5 parameters: model.layers.0.input_layernorm.weight" in record.message


def test_plan_leaving_a_parameter_uncovered_is_named(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    llama = plans.get("llama")
    partial = Plan(name="no-norms", rotate=llama.rotate, replicate=("model.layers.*_layernorm.weight",))
    with pytest.raises(
        PlanError,
        match=r"plan 'no-norms' covers neither rotation nor replication for 1 parameter\(s\): model.norm.weight",
    ):
        hf_rtp.from_pretrained(ckpt, plan=partial)


def test_unknown_plan_name_and_wrong_plan_type(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    with pytest.raises(hf_rtp.UnsupportedModelError, match="no plan for model_type 'falcon'"):
        hf_rtp.from_pretrained(ckpt, plan="falcon")
    with pytest.raises(TypeError, match="plan must be a Plan, a registered model_type or 'auto'"):
        hf_rtp.from_pretrained(ckpt, plan=42)


def test_experts_kind_refuses_a_module_without_fused_experts():
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with pytest.raises(PlanError, match=r"model.layers.0.mlp is a LlamaMLP, but kind 'experts' rotates fused experts"):
        Plan(rotate={"model.layers.*.mlp": "experts"}).resolve(model)
