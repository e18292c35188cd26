"""How a sequence is cut across a ring, and which flash-kernel calls cover its causal mask (one process)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_rtp.distributed.tensors.sequence import SequenceLayout
from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.layers.attention import _blocks, ring_attention


@pytest.mark.parametrize("length,size", [(11, 2), (13, 3), (4, 2), (3, 2), (64, 4), (7, 1)])
def test_ranks_hold_chunks_r_and_2n_minus_1_minus_r_and_all_tokens_once(length, size):
    layout = SequenceLayout(length, size)
    sizes = [layout.chunk(i)[1] - layout.chunk(i)[0] for i in range(2 * size)]
    assert sum(sizes) == length and max(sizes) - min(sizes) <= 1
    tokens = [layout.local_length(r) for r in range(size)]
    assert max(tokens) - min(tokens) <= 1
    positions = torch.cat([layout.positions(r) for r in range(size)])
    assert sorted(positions.tolist()) == list(range(length))
    seq = torch.arange(length).unsqueeze(0) * 10
    for rank in range(size):
        assert torch.equal(layout.shard(seq, 1, rank)[0], layout.positions(rank) * 10)
        assert [c for c in layout.chunks_of(rank)] == [rank, 2 * size - 1 - rank]
    widest = max(tokens)  # shares padded to one size, as an all-gather hands them back: unshard is shard's inverse
    batch = torch.randn(2, length, 3)
    shares = [torch.nn.functional.pad(layout.shard(batch, 1, r), (0, 0, 0, widest - tokens[r])) for r in range(size)]
    assert torch.equal(layout.unshard(shares, 1), batch)
    # causal work per rank: pairs (query, key) with key <= query, balanced by the pairing
    work = [int(sum(p + 1 for p in layout.positions(r).tolist())) for r in range(size)]
    assert max(work) - min(work) <= length  # within one chunk's rows of each other, not a factor of 2N


def _covered(queries, keys, n_rows_q, n_rows_k):
    seen = torch.zeros(n_rows_q, n_rows_k, dtype=torch.int64)
    for (qa, qb), (ka, kb), causal in _blocks(queries, keys):
        part = torch.ones(qb - qa, kb - ka, dtype=torch.int64)
        seen[qa:qb, ka:kb] += part.tril() if causal else part
    return seen


def _positions(runs):
    out = {}
    for row, position, length in runs:
        for i in range(length):
            out[row + i] = position + i
    return out


@pytest.mark.parametrize(
    "queries,keys",
    [
        ([(0, 0, 3), (3, 9, 2)], [(0, 0, 3), (3, 9, 2)]),  # a rank's own chunks
        ([(0, 2, 4)], [(0, 0, 3)]),  # keys start before the queries and end inside them
        ([(0, 0, 5)], [(0, 2, 2)]),  # keys inside the queries
        ([(0, 4, 2)], [(0, 0, 3), (3, 7, 2)]),  # all before, all after
        ([(0, 3, 1)], [(0, 3, 1)]),  # one token
    ],
)
def test_blocks_cover_the_causal_mask_exactly_once(queries, keys):
    q_pos, k_pos = _positions(queries), _positions(keys)
    seen = _covered(queries, keys, len(q_pos), len(k_pos))
    want = torch.tensor([[int(k_pos[k] <= q_pos[q]) for k in range(len(k_pos))] for q in range(len(q_pos))])
    assert torch.equal(seen, want)


@pytest.mark.parametrize("length,size", [(16, 2), (17, 2), (64, 4), (13, 3), (5, 3), (30, 4)])
@pytest.mark.parametrize("pieces", [1, 2])
def test_every_hop_of_whole_chunks_is_one_kernel_call_and_the_mask_exactly(length, size, pieces):
    """Ring attention's calls per hop (issue 51): rank r's queries against each rank's keys, as the ring walks them
    (`rows`, a hop per rank, or `pieces` per rank when K/V walk in pieces). A hop of whole chunks is one call; a piece
    of a hop may take more, but every hop still covers the causal mask exactly once."""
    layout = SequenceLayout(length, size)
    rows = layout.rows((torch.Size((length, 1)),))
    for rank in range(size):
        queries = layout.intervals(rank)
        for owner in range(size):
            start, end = rows.bounds(owner)
            cuts = [start + (end - start) * i // pieces for i in range(pieces + 1)]
            seen, calls = torch.zeros(end - start, dtype=torch.int64), 0
            for a, b in itertools.pairwise(cuts):
                keys = [(row - a, pos, n) for row, pos, n in layout.global_intervals((a, b))]
                q_pos, k_pos = _positions(queries), _positions(keys)
                covered = _covered(queries, keys, len(q_pos), len(k_pos))
                want = [[int(k_pos[k] <= q_pos[q]) for k in range(len(k_pos))] for q in range(len(q_pos))]
                assert torch.equal(covered, torch.tensor(want).reshape(covered.shape))
                calls += len(_blocks(queries, keys))
                seen[a - start : b - start] += 1
            assert seen.eq(1).all()
            if pieces == 1:
                assert calls == 1, (rank, owner, _blocks(queries, keys))


def test_a_ring_of_one_is_sdpa_with_gqa_in_float64():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = ring_attention(q, k, v, 0.3, Ring(None), SequenceLayout(9, 1))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(got, ref, atol=1e-14, rtol=0)
    grad = torch.randn_like(got)
    mine_all, theirs_all = torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    for mine, theirs in zip(mine_all, theirs_all, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-14, rtol=0)


@pytest.mark.parametrize("starts", [(0, 4), (0, 2, 3, 7), (0,)])
def test_packed_documents_attend_within_themselves_exactly_once(starts):
    """Queries and keys cut where documents start: the blocks cover the block-diagonal causal mask."""
    queries = [(0, 0, 5), (5, 9, 2)]  # a rank's two chunks of an 11-token row
    keys = [(0, 0, 5), (5, 5, 4), (9, 9, 2)]
    q_pos, k_pos = _positions(queries), _positions(keys)
    doc = lambda p: max(i for i, s in enumerate(starts) if s <= p)  # noqa: E731
    seen = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
    for (qa, qb), (ka, kb), causal in _blocks(queries, keys, starts):
        part = torch.ones(qb - qa, kb - ka, dtype=torch.int64)
        seen[qa:qb, ka:kb] += part.tril() if causal else part
    want = torch.tensor([[int(k_pos[k] <= q_pos[q] and doc(k_pos[k]) == doc(q_pos[q])) for k in k_pos] for q in q_pos])
    assert torch.equal(seen, want)


def test_rows_packed_differently_each_attend_within_their_documents():
    torch.manual_seed(1)
    q = torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    docs = ((0, 4), (0, 2, 6))
    got = ring_attention(q, k, v, 0.5, Ring(None), SequenceLayout(9, 1), docs)
    index = torch.arange(9)
    masks = []
    for starts in docs:
        doc = torch.bucketize(index, torch.tensor(starts), right=True)
        masks.append((index[None, :] <= index[:, None]) & (doc[None, :] == doc[:, None]))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.stack(masks)[:, None], scale=0.5)
    torch.testing.assert_close(got, ref, atol=1e-14, rtol=0)
    grad = torch.randn_like(got)
    mine_all, theirs_all = torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    for mine, theirs in zip(mine_all, theirs_all, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-14, rtol=0)
