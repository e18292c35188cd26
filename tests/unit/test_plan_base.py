"""Plan.resolve's checks and its answer (plans/base.py) where tests/unit/test_plans.py does not go: a module two
rules give different kinds, a rotated module with parameters of its own below it, the parameters a rotated op
keeps whole (Conv1D's bias), tied parameters under both their names, a long list of uncovered names; and every
registered plan (plans/decoder.py's families, plans/gpt2.py) cutting vanilla's parameter names in two: each
name rotated or replicated, none both, none left out. Models are vanilla transformers' on the meta device."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from support.models import tiny_config
from support.zoo import AUTO, ZOO, zoo_config
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_rtp import plans
from hf_rtp.plans import Plan, PlanError


def _empty(config, auto_class=AutoModelForCausalLM):
    with init_empty_weights():
        return auto_class.from_config(config, dtype=torch.float32)


def _partitions(model, resolution) -> None:
    """Each of vanilla's parameter names (tied ones under every name) is rotated or replicated, exactly once."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(resolution.replicated) == len(set(resolution.replicated))
    assert sorted(names) == sorted([*resolution.rotated_params, *resolution.replicated])


@pytest.mark.parametrize("name", sorted(n for n in ZOO if n not in AUTO))
def test_every_registered_plan_cuts_vanillas_parameter_names_in_two(name):
    model_type = ZOO[name][0]
    model = _empty(zoo_config(name))
    resolution = plans.get(model_type).resolve(model)
    _partitions(model, resolution)
    # the linears that rotate are the layers' projections and the head, and every projection rotates
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    rotated = {m for m, kind in resolution.rotated.items() if kind == "linear"}
    assert rotated == {n for n in linears if n == "lm_head" or n.endswith(("_proj", "_proj_with_mqa"))}
    # what stays whole is norms, routers, attention sinks, positions
    whole = {n.rpartition(".")[2] for n in resolution.replicated}
    assert whole <= {"weight", "bias", "e_score_correction_bias", "sinks"}, whole


def test_a_classifiers_head_stays_whole_beside_a_rotated_backbone():
    for arch in ("llama", "gpt2"):
        model = _empty(tiny_config(arch, num_labels=3), AutoModelForSequenceClassification)
        resolution = plans.get(arch).resolve(model)
        _partitions(model, resolution)
        assert "score.weight" in resolution.replicated and "lm_head" not in resolution.rotated


def test_a_conv1ds_bias_stays_whole_and_tied_parameters_rotate_under_both_names():
    model = _empty(tiny_config("gpt2"))  # as from_pretrained resolves it: on meta, before install ties the head
    untied = plans.get("gpt2").resolve(model)
    model.tie_weights()
    assert model.lm_head.weight is model.transformer.wte.weight
    resolution = plans.get("gpt2").resolve(model)
    _partitions(model, resolution)
    assert resolution == untied
    assert {"lm_head.weight", "transformer.wte.weight"} <= resolution.rotated_params
    # the bias is added after the summed partials, once: whole, though no replicate pattern names it
    assert "transformer.h.0.attn.c_attn.weight" in resolution.rotated_params
    assert "transformer.h.0.attn.c_attn.bias" in resolution.replicated
    gpt2 = plans.get("gpt2")
    assert not any(pattern.endswith(("c_attn.*", "c_attn.bias")) for pattern in gpt2.replicate)
    # a replicate pattern that names it as well is no conflict: it is whole either way
    both = Plan(rotate=gpt2.rotate, replicate=(*gpt2.replicate, "transformer.h.*.attn.*.bias"))
    assert both.resolve(model).replicated.count("transformer.h.0.attn.c_attn.bias") == 1


def test_a_module_two_rules_give_different_kinds_is_named():
    model = _empty(tiny_config("llama"))
    plan = Plan(name="twice", rotate={"lm_head": "linear", "lm_*": "embedding"})
    with pytest.raises(
        PlanError, match=r"plan 'twice': module lm_head matches several kinds \['embedding', 'linear'\]"
    ):
        plan.resolve(model)
    # two rules of one kind are one rule
    llama = plans.get("llama")
    same = Plan(rotate={**llama.rotate, "lm_*": "linear"}, replicate=llama.replicate)
    assert same.resolve(model).rotated == llama.resolve(model).rotated


class _LinearWithAdapter(nn.Linear):
    """Linear's own forward (the linear kind would take it), with a module of parameters below it."""

    def __init__(self, source: nn.Linear):
        super().__init__(source.in_features, source.out_features, bias=False, device="meta")
        self.adapter = nn.Linear(source.in_features, 2, bias=False, device="meta")


def test_a_rotated_module_with_parameters_below_it_is_refused_by_name():
    model = _empty(tiny_config("llama"))
    model.lm_head = _LinearWithAdapter(model.lm_head)
    with pytest.raises(
        PlanError, match=r"plan 'llama': rotated module lm_head has nested parameters \['adapter.weight'\]"
    ):
        plans.get("llama").resolve(model)


def test_a_long_list_of_uncovered_parameters_is_cut_and_counted():
    model = _empty(tiny_config("llama", num_hidden_layers=3))
    llama = plans.get("llama")
    plan = Plan(name="no-norms", rotate=llama.rotate)
    uncovered = [n for n, _ in model.named_parameters() if "norm" in n]
    assert len(uncovered) == 7
    with pytest.raises(PlanError) as raised:
        plan.resolve(model)
    assert f"covers neither rotation nor replication for 7 parameter(s): {', '.join(uncovered)}." in str(raised.value)
    model = _empty(tiny_config("llama", num_hidden_layers=5))
    with pytest.raises(
        PlanError, match=r"for 11 parameter\(s\): model.layers.0.input_layernorm.weight, .* and 3 more\."
    ):
        plan.resolve(model)
