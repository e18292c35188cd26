"""Linears a model calls on the same tokens (layers/siblings.py): which become siblings, what a group learns from
the calls it sees, that it holds neither the tokens nor the modules alive, and (one spawned test on a ring of
two) that a learnt group moves those tokens once for all of them, each output vanilla's linear, and walks
alone again when the tokens changed in place between two calls. The end-to-end count of walks in a decode step
is tests/distributed/test_generate_moves.py's."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
import torch.nn.functional as F
from support.spawn import run_on_ranks
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear

from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.distributed.transport.weights_or_tokens import Traffic
from hf_rtp.layers import RotatedLinear, siblings

HIDDEN = 32


class _Block(nn.Module):
    """q, k and v read the hidden states; o reads the attention's output (another width); `dense` reads the
    hidden states too but adds its bias after the matmul (Falcon's); `gate` and `up` read them too, one with a bias
    and one without; `inner` holds one more of them a level down."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN // 2)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN // 2)
        self.gate_proj = nn.Linear(HIDDEN, 8)
        self.up_proj = nn.Linear(HIDDEN, 8, bias=False)
        self.o_proj = nn.Linear(HIDDEN + 8, HIDDEN)
        self.dense = FalconLinear(HIDDEN, HIDDEN)
        self.inner = nn.Module()
        self.inner.gate = nn.Linear(HIDDEN, 4)


LINEARS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "dense", "inner.gate")


def _vanilla(dtype=torch.float64) -> _Block:
    torch.manual_seed(0)
    return _Block().to(dtype)


def _rotated(vanilla: _Block, ring: Ring) -> _Block:
    """On a ring of one, every weight is this rank's: the module's own parameters."""
    block = copy.deepcopy(vanilla)
    for name in LINEARS:
        source = block.get_submodule(name)
        block.set_submodule(name, RotatedLinear(source, ring=ring, weight=source.weight, bias=source.bias))
    siblings.group(block, (RotatedLinear,))
    siblings.group(block.inner, (RotatedLinear,))
    return block


def _decoding(ring: Ring, tokens: int = 1) -> None:
    """What a forward's start agrees when every rank brings `tokens` tokens and none records gradients."""
    ring.traffic = Traffic(bound=tokens, head=tokens, moves="activations", grad=False)


def test_direct_children_of_one_input_width_are_siblings():
    block = _rotated(_vanilla(), Ring(None))
    group = block.q_proj.siblings
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert group.members == [block.get_submodule(n) for n in names]
    assert all(block.get_submodule(n).siblings is group for n in names)
    # STACKED names q/k/v and gate/up; any of q, k and v may be called first. Gate and up do not stack: one has a bias
    # and the other none, where a stacked walk carries one bundle
    assert group.stacked == {0: [1, 2], 1: [0, 2], 2: [0, 1]}
    # o: alone at its width; dense: its bias is added after the matmul, as its code does; gate: another parent's
    assert not any("siblings" in block.get_submodule(n).__dict__ for n in ("o_proj", "dense", "inner.gate"))


def test_a_group_learns_who_is_called_on_the_tokens_the_first_one_got():
    vanilla, ring = _vanilla(), Ring(None)
    block = _rotated(vanilla, ring)
    group = block.q_proj.siblings

    def call_all(x, names=("q_proj", "k_proj", "v_proj")):
        # a stacked walk's one matmul rounds as a matmul of that shape does: an ulp from each member's own
        for name in names:
            torch.testing.assert_close(
                block.get_submodule(name)(x), vanilla.get_submodule(name)(x), rtol=1e-13, atol=1e-15
            )

    x = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        call_all(x)  # outside a forward's agreed traffic: q, k and v walk stacked, nothing learnt
    call_all(x)  # with gradients (training): the same
    _decoding(ring, 6)
    with torch.no_grad():
        call_all(x)  # a decode step: stacked (STACKED names them), the others' outputs waiting: nothing to learn
    assert group.follow == {}
    group.stacked = {}  # siblings STACKED does not name: a decode step learns who follows whom
    _decoding(ring, 6)
    with torch.no_grad():
        call_all(torch.randn(2, 3, HIDDEN, dtype=torch.float64), ("k_proj", "v_proj"))  # a decode step learns
        assert group.follow == {1: [2]}
        call_all(torch.randn(2, 3, HIDDEN, dtype=torch.float64))  # other tokens: learnt afresh, followers added
        assert group.follow == {1: [2], 0: [1, 2]}
    _decoding(ring, 6)
    with torch.no_grad():
        y = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
        block.q_proj(y)
        y.add_(1)  # changed in place after q read it: not the tokens q got
        call_all(y, ("v_proj",))  # (on a ring of one no tokens move: q walked alone, nothing waits)
        assert group.follow == {1: [2], 0: [1, 2]}
        call_all(y, ("k_proj",))
        assert group.follow == {1: [2], 0: [1, 2], 2: [1]}  # k after v on the same tokens: learnt too


def test_a_group_holds_neither_the_tokens_nor_the_modules_alive():
    ring = Ring(None)
    vanilla = _vanilla()
    block = _rotated(vanilla, ring)
    group = block.q_proj.siblings
    _decoding(ring, 6)
    with torch.no_grad():
        x = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
        seen = weakref.ref(x)
        block.q_proj(x)
        del x  # a prompt's hidden states die with their layer's forward
        assert seen() is None
        z = torch.randn(2, 3, HIDDEN, dtype=torch.float64)  # perhaps in x's memory: other tokens all the same
        torch.testing.assert_close(block.k_proj(z), vanilla.k_proj(z), rtol=1e-13, atol=1e-15)  # stacked
    assert group.follow == {}
    members = [weakref.ref(m) for m in group.members]
    held = weakref.ref(group)
    del block, group
    gc.collect()
    assert held() is None and all(m() is None for m in members)


def test_a_copied_member_walks_alone_and_teaches_the_group_nothing():
    ring = Ring(None)
    vanilla = _vanilla()
    block = _rotated(vanilla, ring)
    copied = copy.deepcopy(block)  # PEFT's modules_to_save copies a layer
    group = block.q_proj.siblings
    assert copied.q_proj.siblings is group and copied.q_proj not in group.members
    _decoding(ring, 6)
    x = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(copied.get_submodule(name)(x), vanilla.get_submodule(name)(x), rtol=0, atol=0)
    assert group.follow == {}


def _walks(declared: bool):
    """On each rank of a ring of two: the token walks and the largest distance from vanilla's outputs, per pass of
    q, k and v over one decode step's hidden states (a token per rank); with `declared`, as STACKED names them,
    else as siblings it does not name."""
    from hf_rtp.distributed.ranks.topology import setup
    from hf_rtp.model.install import rotated_parameter
    from hf_rtp.settings import Settings

    topology = setup(Settings.resolve(device="cpu"))
    ring, rank = topology.ring, topology.rank
    vanilla = _vanilla()
    block = copy.deepcopy(vanilla)
    for name in ("q_proj", "k_proj", "v_proj"):
        source = block.get_submodule(name)
        rows = {}
        for leaf in ("weight", "bias"):
            whole = getattr(source, leaf)
            if whole is not None:
                chunk = whole.detach().chunk(ring.size)[rank].clone()
                rows[leaf] = rotated_parameter(chunk, whole.shape, topology)
        rotated = RotatedLinear(source, ring=ring, **rows)
        ring.plan(rotated.layout, rows["weight"].to_local())  # as install reserves the weight slots
        block.set_submodule(name, rotated)
    siblings.group(block, (RotatedLinear,))
    if not declared:
        block.q_proj.siblings.stacked = {}
    found = []
    for step in range(3):
        _decoding(ring)
        x = torch.randn(1, 1, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        walks, error = ring.token_walks, 0.0
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                out = block.get_submodule(name)(x)
                error = max(error, (out - vanilla.get_submodule(name)(x)).abs().max().item())
                if step == 2 and name == "q_proj":
                    x.add_(1)  # k and v must not take the outputs q's walk computed for the tokens before
        found.append((ring.token_walks - walks, error))
    return found


def test_a_learnt_group_moves_its_tokens_once_for_all_and_each_output_is_vanillas():
    for found in run_on_ranks(_walks, 2, False):
        walks = [count for count, _ in found]
        # learning: each walks alone (k and v move only their outputs: the tokens arrived with q's); then one walk
        # for the three; then q's group walk, and k and v each alone on the changed tokens
        assert walks == [3, 1, 3], found
        # every output vanilla's, also k's and v's on tokens changed in place after q's walk moved them: the ring
        # compares the identities recorded when they moved, not those of the tensors it kept (which share the
        # changed tensor's version counter)
        assert all(error < 1e-12 for _, error in found), found


def test_a_declared_group_moves_its_tokens_once_from_the_first_step():
    for found in run_on_ranks(_walks, 2, True):
        # one token walk for the three from the start; then, on tokens changed in place after q's walk, k and v
        # each walk alone
        assert [count for count, _ in found] == [1, 1, 3], found
        assert all(error < 1e-12 for _, error in found), found


def test_stacked_outputs_take_in_place_ops_and_inference_mode_walks_alone():
    vanilla, ring = _vanilla(), Ring(None)
    block = _rotated(vanilla, ring)
    x = torch.randn(2, 3, HIDDEN, dtype=torch.float64, requires_grad=True)
    outs = [block.get_submodule(n)(x) for n in ("q_proj", "k_proj", "v_proj")]  # one stacked walk
    for out in outs:
        out.mul_(2)  # a view of the stacked output would refuse this under autograd
    sum(o.sum() for o in outs).backward()
    assert x.grad is not None
    with torch.inference_mode():  # inference tensors have no version counter to know tokens by: each walks alone
        y = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(block.get_submodule(name)(y), vanilla.get_submodule(name)(y), rtol=0, atol=0)


def test_a_stacked_output_nothing_used_gets_zeros_and_the_others_their_exact_gradients():
    """layers/stacked.py's backward builds the stacked output gradient from each member's slices; an output
    nothing used has no gradient (None) and stands as zeros, so the other members' gradients are F.linear's."""
    from hf_rtp.distributed.tensors.sharding import ChunkLayout, StackedLayout
    from hf_rtp.layers.stacked import stacked_linear

    torch.manual_seed(0)
    weights = [torch.randn(rows, 6, dtype=torch.float64, requires_grad=True) for rows in (5, 3, 4)]
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    layout = StackedLayout.of(tuple(ChunkLayout((w.shape,), 1) for w in weights))
    outputs = stacked_linear(x, Ring(None), layout, weights, None)
    (outputs[0].square().sum() + outputs[2].sum()).backward()  # outputs[1] unused
    got = [x.grad, *(w.grad for w in weights)]
    for t in (x, *weights):
        t.grad = None
    (
        F.linear(x, weights[0]).square().sum() + F.linear(x, weights[2]).sum() + 0 * F.linear(x, weights[1]).sum()
    ).backward()
    for mine, theirs in zip(got, [x.grad, *(w.grad for w in weights)], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
