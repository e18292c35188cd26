"""Fused MoE experts (transformers >= 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]) cut in expert groups.

Each step runs this rank's tokens that the router sent to the held experts and adds their weighted
outputs; the router itself stays replicated. Tokens are sorted by expert once per forward, so every
expert's activations are a contiguous row range of three saved tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ring import Ring
from ..sharding import ChunkLayout
from .common import add_matmul, autocast_dtype, finish_weight_grads, local


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


class _RotatedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up, down, ring: Ring, layout: ChunkLayout, act_fn, dtype):
        # `dtype`: the matmuls' (autocast's, if on); the output keeps the residual stream's, as in vanilla
        routes = _Routes(top_k_index, layout.rows)
        inter = down.shape[-1]
        gu_all = hidden.new_empty(routes.rows, 2 * inter, dtype=dtype)
        h_all = hidden.new_empty(routes.rows, inter, dtype=dtype)
        y_all = hidden.new_empty(routes.rows, hidden.shape[-1], dtype=dtype)
        out = torch.zeros_like(hidden)

        def compute(rows, chunk):
            gate_up_j, down_j = chunk
            for e, start, end, token, slot in routes.held(rows):
                gu = torch.mm(hidden[token].to(dtype), gate_up_j[e].to(dtype).t(), out=gu_all[start:end])
                gate, up = gu.chunk(2, dim=-1)
                h = torch.mul(act_fn(gate), up, out=h_all[start:end])
                y = torch.mm(h, down_j[e].to(dtype).t(), out=y_all[start:end])
                out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))

        with torch.autocast(hidden.device.type, enabled=False):
            ring.forward_walk([gate_up, down], layout, compute)
        ctx.save_for_backward(hidden, top_k_weights, gate_up, down, gu_all, h_all, y_all)
        ctx.routes, ctx.ring, ctx.layout, ctx.act_fn = routes, ring, layout, act_fn
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, top_k_weights, gate_up, down, gu_all, h_all, y_all = ctx.saved_tensors
        routes, layout, act_fn = ctx.routes, ctx.layout, ctx.act_fn
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weights = torch.zeros_like(top_k_weights) if ctx.needs_input_grad[2] else None
        wants_weight_grads = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dgu_all = torch.empty_like(gu_all)

        def expert_grads(rows, chunk, acc):
            """Per held expert: routing-weight grads, d(gate_up) rows, and (with acc) weight grads."""
            _, down_j = chunk
            for e, start, end, token, slot in routes.held(rows):
                g = grad_out[token]
                if grad_weights is not None:
                    grad_weights[token, slot] = (g * y_all[start:end]).sum(-1).to(grad_weights.dtype)
                gy = (g * top_k_weights[token, slot, None]).to(gu_all.dtype)
                dh = gy @ down_j[e].to(gy.dtype)
                gate, up = gu_all[start:end].chunk(2, dim=-1)
                with torch.enable_grad():
                    gate = gate.detach().requires_grad_()
                    activated = act_fn(gate)
                    (dgate,) = torch.autograd.grad(activated, gate, dh * up)
                dgu = dgu_all[start:end]
                dgu[:, : up.shape[-1]] = dgate
                dgu[:, up.shape[-1] :] = dh * activated.detach()
                if acc is not None:
                    add_matmul(acc[0][e], dgu.t(), hidden[token].to(dgu.dtype))
                    add_matmul(acc[1][e], gy.t(), h_all[start:end])

        def input_grad(rows, chunk):
            if not wants_weight_grads:  # expert_grads did not run in accumulate
                expert_grads(rows, chunk, None)
            if grad_hidden is None:
                return
            gate_up_j, _ = chunk
            for e, start, end, token, _ in routes.held(rows):
                grad = dgu_all[start:end] @ gate_up_j[e].to(dgu_all.dtype)
                grad_hidden.index_add_(0, token, grad.to(grad_hidden.dtype))

        landed = ctx.ring.backward_walk(
            [gate_up, down],
            layout,
            expert_grads if wants_weight_grads else None,
            input_grad,  # always: both the weight and the input grads need the held weights
        )
        grad_gate_up, grad_down = finish_weight_grads(ctx, landed, ctx.ring.size, positions=(3, 4))
        return grad_hidden, None, grad_weights, grad_gate_up, grad_down, None, None, None, None


class RotatedExperts(nn.Module):
    """Replaces a fused experts module; same parameter names (gate_up_proj, down_proj), Shard(0) over experts."""

    def __init__(self, source: nn.Module, *, ring: Ring, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        super().__init__()
        self.num_experts = gate_up_proj.shape[0]
        self.hidden_dim, self.intermediate_dim = down_proj.shape[1], down_proj.shape[2]
        self.act_fn = source.act_fn
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.ring = ring
        self.layout = ChunkLayout((gate_up_proj.shape, down_proj.shape), ring.size)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _RotatedExpertsFn.apply(
            hidden_states,
            top_k_index,
            top_k_weights,
            local(self.gate_up_proj),
            local(self.down_proj),
            self.ring,
            self.layout,
            self.act_fn,
            autocast_dtype(hidden_states) or hidden_states.dtype,
        )


def is_fused_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (
        hasattr(module, "act_fn")
        and {"gate_up_proj", "down_proj"} <= set(params)
        and all(params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))
    )
