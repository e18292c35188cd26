"""What every rotated op shares (layers/common.py): the input cast autocast would make, the gradient sums, the
forwards it recognises by their code, and `rotate_forward`'s choice of moving an op's weights or its tokens
from the numbers its ranks agreed on. The agreement itself and Traffic.moves_tokens' cost rule are in
test_traffic.py; here, what an op does with them: on a ring of one it never moves tokens, and on a ring of two
(one spawned test) each case of the choice, with the output the op's vanilla linear gives either way."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from support.spawn import run_on_ranks

from hf_rtp.distributed.tensors.sharding import ChunkLayout
from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.distributed.transport.weights_or_tokens import Traffic
from hf_rtp.layers.common import add_matmul, autocast_dtype, cast_for_matmul, local, rotate_forward, source_text
from hf_rtp.layers.linear import _RotatedLinearFn


def test_the_input_cast_is_the_one_autocast_gives_a_matmul():
    x = torch.randn(3, 4)
    assert cast_for_matmul(x) is x and autocast_dtype(x) is None
    w = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(x) == torch.bfloat16
        cast = cast_for_matmul(x)
        assert cast.dtype == F.linear(x, w).dtype == torch.bfloat16
        torch.testing.assert_close(F.linear(cast, w.to(cast.dtype)), F.linear(x, w), rtol=0, atol=0)
        # autocast leaves float64 and integer inputs alone, and so does the cast
        x64, ids = x.double(), torch.arange(4)
        assert cast_for_matmul(x64) is x64 and F.linear(x64, w.double()).dtype == torch.float64
        assert cast_for_matmul(ids) is ids


def test_a_gradient_sum_is_in_place_or_cast_back_as_vanillas_grad_is():
    a, b, acc = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 5)
    acc64 = acc.double()
    expected = acc64 + a @ b
    storage = acc64.data_ptr()
    add_matmul(acc64, a, b)
    assert acc64.data_ptr() == storage
    torch.testing.assert_close(acc64, expected)
    # under autocast: a bf16 product, accumulated into the parameter's float32 as autograd accumulates .grad
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    before = acc.clone()
    add_matmul(acc, a16, b16)
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc, before + (a16 @ b16).float(), rtol=0, atol=0)


def test_a_frozen_weight_or_bias_gets_no_gradient_and_the_other_vanillas():
    ring = Ring(None)
    for frozen in ("weight", "bias"):
        x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
        w = torch.randn(4, 5, dtype=torch.float64, requires_grad=frozen != "weight")
        b = torch.randn(4, dtype=torch.float64, requires_grad=frozen != "bias")
        out = _RotatedLinearFn.apply(x, w, b, ring, ChunkLayout((w.shape, b.shape), 1))
        grad = torch.randn_like(out)
        out.backward(grad)
        theirs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, w, b)]
        F.linear(*theirs).backward(grad)
        for ours, vanilla in zip((x, w, b), theirs, strict=True):
            assert (ours.grad is None) == (vanilla.grad is None), frozen
            if vanilla.grad is not None:
                torch.testing.assert_close(ours.grad, vanilla.grad)


def test_a_ring_of_one_walks_its_weights_even_when_tokens_were_agreed():
    ring = Ring(None)
    ring.traffic = Traffic(bound=1, head=1, moves="activations", grad=False)
    w = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(1, 4, dtype=torch.float64)
    out = torch.zeros(1, 8, dtype=torch.float64)
    calls = []

    def compute(tokens, into, rows, chunk):
        calls.append(rows)
        into[:, rows[0] : rows[1]] = F.linear(tokens[0], chunk[0])

    rotate_forward(ring, [w], ChunkLayout((w.shape,), 1), [x], [0.0], out, compute, head=True)
    assert calls == [(0, 8)] and ring.token_walks == 0 and ring.sent_bytes == 0  # one step, no communication
    torch.testing.assert_close(out, F.linear(x, w))


def _decorated(f):
    return f


@_decorated
def _annotated(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """A docstring is not code."""
    # nor is a comment
    return x * scale


def test_a_forward_is_recognised_by_its_code_alone():
    assert source_text(_annotated) == "def _annotated(x, scale=2.0):\n    return x * scale"
    assert (
        source_text(torch.nn.Linear.forward)
        == "def forward(self, input):\n    return F.linear(input, self.weight, self.bias)"
    )
    assert source_text(len) is None  # no Python source
    assert source_text(lambda x: x) is None  # not a def


def _choices(wide: int, rows: int):
    """On each rank of a ring of two: for each case, whether the op moved its tokens, and its largest distance from
    vanilla's F.linear on the whole weight (every rank builds the whole weight from one seed, keeps its rows)."""
    from hf_rtp.distributed.ranks.topology import setup
    from hf_rtp.model.install import rotated_parameter
    from hf_rtp.settings import Settings

    topology = setup(Settings.resolve(device="cpu"))
    ring, rank = topology.ring, topology.rank
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(rows, wide, dtype=torch.float64, generator=generator)
    layout = ChunkLayout((whole.shape,), ring.size)
    start, end = layout.bounds(rank)
    param = rotated_parameter(whole[start:end].clone(), whole.shape, topology)
    own = local(param)  # this rank's rows, connected to the parameter's gradient
    assert torch.equal(own, whole[start:end]) and type(own) is torch.Tensor and own.requires_grad
    ring.plan(layout, own)  # the weight slots a token walk must fit in, as install reserves them

    def compute(tokens, into, rows_, chunk):
        into[:, rows_[0] : rows_[1]] = F.linear(tokens[0], chunk[0])

    def run(tokens, traffic, **flags):
        x = torch.randn(tokens, wide, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
        out = torch.full((tokens, rows), float("nan"), dtype=torch.float64)
        ring.traffic, walks = traffic, ring.token_walks
        rotate_forward(ring, [own.detach()], layout, [x], [0.0], out, compute, x.dtype, **flags)
        ring.traffic = None
        return ring.token_walks - walks, (out - F.linear(x, whole)).abs().max().item()

    def agreed(bound, moves="activations", grad=False, head=1):
        return Traffic(bound=bound, head=head, moves=moves, grad=grad)

    found = {
        "outside a forward": run(2, None),
        "agreed tokens": run(2, agreed(2)),
        "fewer than agreed": run(1 + rank, agreed(2)),
        "more than the slots hold": run(3, agreed(3)),
        "auto, weights cheaper": run(2, agreed(2, moves="auto")),
        "its backward reads them, some rank records": run(2, agreed(2, grad=True), backward=True),
        "its backward reads them, no rank records": run(2, agreed(2), backward=True),
        "a head, by sequences": run(1, agreed(3, head=1), head=True),
        "more than agreed, then fits": run(1 + rank, agreed(1)),
        "more than agreed, then too many": run(1 + 2 * rank, agreed(1)),
    }
    # a backward's recomputation (gradient checkpointing) runs outside the forward the ranks agreed on
    inside = []
    y = torch.ones(1, requires_grad=True) * 2
    y.register_hook(lambda g: inside.append(run(2, agreed(2))))
    y.sum().backward()
    found["in a backward"] = inside[0]
    # the rotated parameter's gradient comes home through local(): its rows, on the parameter
    (own * 3).sum().backward()
    found["gradient on the parameter"] = (type(param.grad).__name__, param.grad.to_local().eq(3).all().item())
    return found


def test_an_op_moves_its_tokens_exactly_when_the_agreed_numbers_say_so_and_computes_the_same():
    # 32 of 64 rows x 16 float64 per rank: a 4 KB slot. A token row carries 16 + 64 values (input and output):
    # two rows per rank fit what a token walk holds in a slot, three do not.
    per_rank = run_on_ranks(_choices, 2, 16, 64)
    for rank, found in enumerate(per_rank):
        assert found.pop("gradient on the parameter") == ("RotatedTensor", True)
        walks = {case: count for case, (count, _) in found.items()}
        assert walks == {
            "outside a forward": 0,
            "agreed tokens": 1,
            "fewer than agreed": 1,  # rank 0's single token travels padded to rank 1's two
            "more than the slots hold": 0,
            "auto, weights cheaper": 0,  # one hop of 4 KB against two of tokens, each a message's latency
            "its backward reads them, some rank records": 0,
            "its backward reads them, no rank records": 1,
            "a head, by sequences": 1,  # generate's last tokens: one a sequence, though the forward brought 3
            # rank 1 brings more than agreed: every rank learns it from the walk and walks again by the true count
            "more than agreed, then fits": 2,
            "more than agreed, then too many": 1,  # ... or moves the weights, when that count does not fit
            "in a backward": 0,
        }, rank
        assert all(error < 1e-12 for _, error in found.values()), (rank, found)
