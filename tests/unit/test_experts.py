"""Fused MoE experts rotated (layers/experts.py) on a ring of one, against transformers' own experts modules run
eagerly in the same process: Mixtral's ([E, 2I, H], act(gate) * up) and gpt-oss's (transposed [E, H, 2I], biases,
its clamped interleaved GLU). The output and the gradients of the hidden states, the routing weights and every
expert weight; the explicit backward by finite differences; slots routed to no expert; the parameters' names
and order; and which modules the experts kind takes. Expert groups over several ranks are tests/distributed's
(Mixtral at 2 and 3 ranks, the MoE families of the zoo)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import GptOssConfig, MixtralConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.layers import LAYERS, RotatedExperts
from hf_rtp.layers.experts import _RotatedExpertsFn

EXPERTS, HIDDEN, INTER, TOP_K = 4, 6, 5, 2


def _vanilla(kind: str, dtype=torch.float64):
    if kind == "mixtral":
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
        cls = MixtralExperts
    else:
        config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, swiglu_limit=1.5)
        cls = GptOssExperts
    config._experts_implementation = "eager"  # transformers' reference loop (grouped_mm has no float64 kernel)
    torch.manual_seed(0)
    experts = cls(config).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)  # the clamp of gpt-oss's GLU (1.5) bites for some entries
    return experts


def _rotate(vanilla):
    source = copy.deepcopy(vanilla)
    leaves = dict(source.named_parameters(recurse=False))
    return RotatedExperts(source, ring=Ring(None), **leaves)


def _routing(tokens: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, dtype=torch.float64, generator=generator).softmax(-1)
    return index, weights


def _compare(kind, index, routing):
    vanilla = _vanilla(kind)
    rotated = _rotate(vanilla)
    hidden = torch.randn(index.shape[0], HIDDEN, dtype=torch.float64)
    inputs = {}
    outputs = {}
    for name, module in (("rotated", rotated), ("vanilla", vanilla)):
        h, w = hidden.clone().requires_grad_(), routing.clone().requires_grad_()
        inputs[name] = (h, w)
        outputs[name] = module(h, index, w)
    torch.testing.assert_close(outputs["rotated"], outputs["vanilla"])
    grad = torch.randn_like(hidden)
    for name in outputs:
        outputs[name].backward(grad)
    for ours, theirs in zip(inputs["rotated"], inputs["vanilla"], strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    for name, param in vanilla.named_parameters():
        torch.testing.assert_close(rotated.get_parameter(name).grad, param.grad, msg=f"{kind}: {name}")
    return rotated, vanilla


def test_mixtral_experts_output_and_every_gradient_equal_vanillas():
    index, routing = _routing(9)
    _compare("mixtral", index, routing)


def test_gpt_oss_experts_output_and_every_gradient_equal_vanillas():
    index, routing = _routing(9)
    rotated, vanilla = _compare("gpt_oss", index, routing)
    assert rotated.is_transposed and rotated.hidden_dim == HIDDEN and rotated.intermediate_dim == INTER
    # gpt-oss's own keywords, as its MLP may call its experts
    hidden = torch.randn(9, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            rotated(hidden, router_indices=index, routing_weights=routing), vanilla(hidden, index, routing)
        )


def test_a_slot_routed_to_no_expert_adds_nothing_as_in_vanilla():
    index, routing = _routing(7)
    index[2, 1] = index[5, 0] = EXPERTS  # transformers' masking index: one past the last expert
    index[4] = EXPERTS  # a token no expert serves
    _compare("mixtral", index, routing)


def test_parameters_keep_vanillas_names_and_order():
    for kind in ("mixtral", "gpt_oss"):
        vanilla = _vanilla(kind)
        rotated = _rotate(vanilla)
        assert [(n, p.shape) for n, p in rotated.named_parameters()] == [
            (n, p.shape) for n, p in vanilla.named_parameters()
        ], kind


def test_backward_by_gradcheck():
    vanilla = _vanilla("mixtral")
    rotated = _rotate(vanilla)
    index, routing = _routing(5)
    hidden = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    routing.requires_grad_()
    weights = [p.detach().clone().requires_grad_() for p in rotated._weights()]

    def run(hidden, routing, *weights):
        return _RotatedExpertsFn.apply(hidden, index, routing, rotated, torch.float64, *weights)

    assert torch.autograd.gradcheck(run, (hidden, routing, *weights))


class _PlainExperts(nn.Module):
    """Fused 3-D weights, but not declared through transformers' use_experts_implementation."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
        self.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_the_kind_takes_only_experts_transformers_declares():
    refusal = LAYERS["experts"].refusal
    assert refusal(_vanilla("mixtral")) is None and refusal(_vanilla("gpt_oss")) is None
    assert refusal(_PlainExperts()) == "its class is not declared through transformers' use_experts_implementation"
    assert refusal(nn.Linear(2, 2)) == "it holds no fused 3-D gate_up_proj and down_proj"
    extra = _vanilla("mixtral")
    extra.scale = nn.Parameter(torch.ones(1))
    assert (
        refusal(extra) == "its parameters are ['down_proj', 'gate_up_proj', 'scale'], not ['down_proj', 'gate_up_proj']"
    )
