"""Fused MoE experts cut in expert groups, in every layout transformers declares for them.

transformers >= 5 declares each fused experts class through `use_experts_implementation`: whether
its weights are transposed (gpt-oss: gate_up_proj [E, H, 2I]) or not ([E, 2I, H]), whether they
carry biases, and its `_apply_gate` (act(gate) * up, or gpt-oss's clamped interleaved GLU). Its
grouped_mm and batched_mm kernels rely on exactly that declaration; so do we. Each step runs this
rank's tokens that the router sent to the held experts and adds their weighted outputs; the router
stays replicated. Tokens are sorted by expert once per forward, so every expert's activations are
a contiguous row range of three saved tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from ..errors import RotatedStateError
from ..private.transformers_names import experts_gate
from .common import add_matmul, autocast_dtype, finish_weight_grads, local, rotate_forward

_FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")


class _Routes:
    """Which (token, top-k slot) pairs each expert serves, as row ranges of one expert-sorted order."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        flat = top_k_index.reshape(-1)
        k = top_k_index.shape[-1]
        order = torch.argsort(flat, stable=True)
        self.token, self.slot = order // k, order % k
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
        self.bounds, start = [], 0
        for count in counts:  # ids >= num_experts mean "no expert" and sort to the end, unused
            self.bounds.append((start, start + count))
            start += count
        self.rows = start

    def held(self, experts: tuple[int, int]):
        """For each held expert that has tokens: its index in the held piece, its rows, tokens, slots."""
        first, last = experts
        for e in range(first, last):
            start, end = self.bounds[e]
            if start != end:
                yield e - first, start, end, self.token[start:end], self.slot[start:end]


def _project(x: torch.Tensor, weight: torch.Tensor, bias, transposed: bool, out=None) -> torch.Tensor:
    """x @ W (transposed layout [in, out]) or x @ W.T ([out, in]), plus the bias."""
    y = torch.mm(x, weight if transposed else weight.t(), out=out)
    return y if bias is None else y.add_(bias)


def _back(grad: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The input's gradient of _project."""
    return grad @ (weight.t() if transposed else weight)


class _RotatedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, experts: RotatedExperts, dtype, *weights):
        # `dtype`: the matmuls' (autocast's, if on); the output keeps the residual stream's, as in vanilla
        routes = _Routes(top_k_index, experts.layout.rows)
        transposed = experts.is_transposed
        inter, width = experts.intermediate_dim, experts.hidden_dim
        gu_all = hidden.new_empty(routes.rows, 2 * inter, dtype=dtype)
        h_all = hidden.new_empty(routes.rows, inter, dtype=dtype)
        y_all = hidden.new_empty(routes.rows, width, dtype=dtype)
        out = torch.zeros_like(hidden)

        def compute(tokens, out, rows, chunk):
            hidden_j, index_j, weights_j = tokens
            mine = index_j is top_k_index  # else another rank's tokens, moved here (Ring.token_walk): no backward
            routes_j = routes if mine else _Routes(index_j, experts.layout.rows)
            gu_j, h_j, y_j = (
                (gu_all, h_all, y_all)
                if mine
                else (t.new_empty(routes_j.rows, t.shape[1]) for t in (gu_all, h_all, y_all))
            )
            gate_up_j, down_j, *biases = chunk
            for e, start, end, token, slot in routes_j.held(rows):  # cast per expert: no cast copy of the chunk
                b_gu, b_d = (biases[0][e].to(dtype), biases[1][e].to(dtype)) if biases else (None, None)
                x = hidden_j[token].to(dtype)
                gu = _project(x, gate_up_j[e].to(dtype), b_gu, transposed, out=gu_j[start:end])
                h_j[start:end] = experts.apply_gate(gu)
                y = _project(h_j[start:end], down_j[e].to(dtype), b_d, transposed, out=y_j[start:end])
                out.index_add_(0, token, (y * weights_j[token, slot, None]).to(out.dtype))

        with torch.autocast(hidden.device.type, enabled=False):
            tokens, fill = [hidden, top_k_index, top_k_weights], [0.0, experts.layout.rows, 0.0]
            # backward reads every expert's activations of this rank's tokens: only a forward without
            # gradients may compute them elsewhere
            rotate_forward(
                experts.ring,
                weights,
                experts.layout,
                tokens,
                fill,
                out,
                compute,
                dtype,
                backward=any(ctx.needs_input_grad),
            )
        ctx.save_for_backward(hidden, top_k_weights, gu_all, h_all, y_all, *weights)
        ctx.routes, ctx.experts = routes, experts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, top_k_weights, gu_all, h_all, y_all, *weights = ctx.saved_tensors
        routes, experts = ctx.routes, ctx.experts
        transposed, biased = experts.is_transposed, len(weights) == 4
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weights = torch.zeros_like(top_k_weights) if ctx.needs_input_grad[2] else None
        wants_weight_grads = any(ctx.needs_input_grad[5:])
        dgu_all = torch.empty_like(gu_all)

        def expert_grads(rows, chunk, acc):
            """Per held expert: routing-weight grads, d(gate_up) rows, and (with acc) weight grads."""
            down_j = chunk[1]
            for e, start, end, token, slot in routes.held(rows):
                g = grad_out[token]
                if grad_weights is not None:
                    grad_weights[token, slot] = (g * y_all[start:end]).sum(-1).to(grad_weights.dtype)
                gy = (g * top_k_weights[token, slot, None]).to(gu_all.dtype)
                dh = _back(gy, down_j[e].to(gy.dtype), transposed)
                with torch.enable_grad():
                    gu = gu_all[start:end].detach().requires_grad_()
                    (dgu,) = torch.autograd.grad(experts.apply_gate(gu), gu, dh)
                dgu_all[start:end] = dgu
                if acc is not None:
                    x, h = hidden[token].to(dgu.dtype), h_all[start:end]
                    add_matmul(acc[0][e], *((x.t(), dgu) if transposed else (dgu.t(), x)))
                    add_matmul(acc[1][e], *((h.t(), gy) if transposed else (gy.t(), h)))
                    if biased:
                        acc[2][e].add_(dgu.sum(0))
                        acc[3][e].add_(gy.sum(0))

        def input_grad(rows, chunk):
            if not wants_weight_grads:  # expert_grads did not run in accumulate
                expert_grads(rows, chunk, None)
            if grad_hidden is None:
                return
            gate_up_j = chunk[0]
            for e, start, end, token, _ in routes.held(rows):
                grad = _back(dgu_all[start:end], gate_up_j[e].to(dgu_all.dtype), transposed)
                grad_hidden.index_add_(0, token, grad.to(grad_hidden.dtype))

        landed = experts.ring.backward_walk(
            list(weights),
            experts.layout,
            expert_grads if wants_weight_grads else None,
            input_grad,  # always: both the weight and the input grads need the held weights
            dtype=gu_all.dtype,
        )
        grads = finish_weight_grads(ctx, landed, experts.ring, weights, positions=range(5, 5 + len(weights)))
        return grad_hidden, None, grad_weights, None, None, *grads


class RotatedExperts(nn.Module):
    """Replaces a fused experts module; same parameter names, Shard(0) over experts."""

    def __init__(
        self,
        source: Any,  # duck-typed: any fused experts class whose forward the plan's check accepted
        *,
        ring: Ring,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        gate_up_proj_bias: nn.Parameter | None = None,
        down_proj_bias: nn.Parameter | None = None,
    ):
        super().__init__()
        self.num_experts = gate_up_proj.shape[0]
        self.is_transposed = bool(source.is_transposed)
        self.hidden_dim = down_proj.shape[2] if self.is_transposed else down_proj.shape[1]
        self.intermediate_dim = down_proj.shape[1] if self.is_transposed else down_proj.shape[2]
        # the class's own gate (a bound method, not a submodule): act(gate) * up, or gpt-oss's GLU
        self.apply_gate = experts_gate(source)
        given = dict(
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
            gate_up_proj_bias=gate_up_proj_bias,
            down_proj_bias=down_proj_bias,
        )
        for leaf in [*source._parameters, *given]:  # the source's order first: named_parameters() as vanilla
            if leaf not in self._parameters:
                setattr(self, leaf, given[leaf])
        self.ring = ring
        self.layout = ChunkLayout(tuple(w.shape for w in self._weights()), ring.size)

    def _weights(self) -> list[torch.Tensor]:
        params = self._parameters
        if "gate_up_proj" not in params or "down_proj" not in params:  # a parametrization moved it (on every rank)
            raise RotatedStateError(
                "a rotated experts layer's gate_up_proj or down_proj was replaced by a parametrization (PEFT's LoRA "
                "target_parameters, torch.nn.utils.parametrize): adapters on rotated expert weights are not "
                "supported. Leave the experts out of target_parameters (LoRA through target_modules works)"
            )
        biases = ["gate_up_proj_bias", "down_proj_bias"] if params.get("gate_up_proj_bias") is not None else []
        return [t for t in (params[n] for n in ["gate_up_proj", "down_proj", *biases]) if t is not None]

    def forward(
        self, hidden_states, top_k_index=None, top_k_weights=None, *, router_indices=None, routing_weights=None
    ):
        top_k_index = router_indices if top_k_index is None else top_k_index  # gpt-oss's names
        top_k_weights = routing_weights if top_k_weights is None else top_k_weights
        dtype = autocast_dtype(hidden_states) or hidden_states.dtype
        weights = [local(w) for w in self._weights()]
        return _RotatedExpertsFn.apply(hidden_states, top_k_index, top_k_weights, self, dtype, *weights)


def experts_refusal(module: nn.Module) -> str | None:
    """Why the experts kind cannot reproduce this module exactly, or None when it can."""
    params = dict(module.named_parameters(recurse=False))
    if not {"gate_up_proj", "down_proj"} <= set(params) or any(
        params[n].dim() != 3 for n in ("gate_up_proj", "down_proj")
    ):
        return "it holds no fused 3-D gate_up_proj and down_proj"
    if any(not hasattr(module, flag) for flag in _FLAGS) or not hasattr(type(module).forward, "__wrapped__"):
        return "its class is not declared through transformers' use_experts_implementation"
    if not module.has_gate or module.has_post_expert_norm or getattr(module, "_is_expert_parallel", False):
        return "it has no gate, or a post-expert norm, or is expert-parallel already"
    expected = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if module.has_bias else set())
    if set(params) != expected:
        return f"its parameters are {sorted(params)}, not {sorted(expected)}"
    return None
