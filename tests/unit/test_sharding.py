import itertools

import pytest
import torch

from hf_rtp.distributed.tensors.sharding import ChunkLayout, chunk_rows


@pytest.mark.parametrize("n", [0, 1, 2, 5, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_chunk_rows_cut_like_torch_chunk(n, world):
    pieces = torch.chunk(torch.arange(n), world) if n else ()
    expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    got = [chunk_rows(n, world, j) for j in range(world)]
    assert [g for g in got if g[1] > g[0]] == expected
    assert got[0][0] == 0 and got[-1][1] == n  # every row covered once, in order
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


def test_layout_bundles_weight_and_bias():
    layout = ChunkLayout((torch.Size([10, 4]), torch.Size([10])), 3)
    assert layout.shapes(2) == [torch.Size([2, 4]), torch.Size([2])]
    assert layout.max_numel() == 4 * 4 + 4
    with pytest.raises(ValueError, match="share dim 0"):
        ChunkLayout((torch.Size([10, 4]), torch.Size([9])), 3)


def test_chunk_zero_and_its_first_piece_are_the_largest():
    """ChunkLayout sizes the pool from chunk 0's piece 0; check that against every chunk and piece."""
    import math

    import torch

    from hf_rtp.distributed.tensors.sharding import ChunkLayout

    for rows in (1, 2, 5, 10, 101):
        for world in (1, 2, 3, 4, 7):
            layout = ChunkLayout((torch.Size((rows, 3)), torch.Size((rows,))), world)
            numels = [sum(math.prod(s) for s in layout.shapes(j)) for j in range(world)]
            assert layout.max_numel() == max(numels)
            for cap in (1, 4, 9, 1000):
                pieces = layout.pieces_for(cap)
                sizes = [
                    sum(math.prod(s) for s in layout.shapes_of(layout.piece(j, p, pieces)))
                    for j in range(world)
                    for p in range(pieces)
                ]
                assert layout.max_piece_numel(pieces) == max(sizes)
                assert max(sizes) <= max(cap, 4)  # within the cap, unless one row (4 elements) is larger


def test_what_a_walk_asks_is_computed_once_and_equals_the_rule():
    """A walk reads each piece's rows and shapes from `walk`, computed once per layout: it must equal the torch.chunk
    rule (`piece`, `shapes_of`) for plain and stacked layouts, uneven and empty chunks, and leave equality and hashing
    to the fields (a layout keyed in a dict before and after a walk is the same key)."""
    import copy

    from hf_rtp.distributed.tensors.sequence import SpanLayout
    from hf_rtp.distributed.tensors.sharding import StackedLayout

    cases = [SpanLayout((torch.Size((6, 3)),), 2, (0, 5, 6)), SpanLayout((torch.Size((9, 2)),), 3, (0, 0, 7, 9))]
    for rows in (1, 5, 10, 101):
        for world in (1, 2, 3, 4, 7):
            cases.append(ChunkLayout((torch.Size((rows, 3)), torch.Size((rows,))), world))
            cases.append(
                StackedLayout.of(tuple(ChunkLayout((torch.Size((r, 3)),), world) for r in (rows, 2, rows + 3)))
            )
    for layout in cases:
        twin = copy.deepcopy(layout)
        key = hash(layout)
        for pieces in (1, 2, 3):
            cut = layout.walk(pieces)
            assert layout.walk(pieces) is cut  # computed once
            for p in range(pieces):
                for index in range(layout.world_size):
                    rows = twin.piece(index, p, pieces)
                    assert cut[p][index] == (rows, tuple(twin.shapes_of(rows)))
        for index in range(layout.world_size):
            assert layout.bounds(index) == type(layout)._bounds(twin, index)
            assert layout.shapes(index) == twin.shapes_of(twin.bounds(index))
        if not isinstance(layout, SpanLayout):  # a span layout has no chunk past its ranks'
            assert layout.bounds(layout.world_size + 1) == type(layout)._bounds(twin, layout.world_size + 1)
        assert hash(layout) == key and layout == twin and copy.deepcopy(layout) == layout
    # a span layout's chunks are its ranks' token counts, not torch.chunk's
    span = SpanLayout((torch.Size((6, 3)),), 2, (0, 5, 6))
    assert [span.bounds(i) for i in range(2)] == [(0, 5), (5, 6)]
    assert span.walk(2)[1][0] == ((3, 5), (torch.Size((2, 3)),))  # chunk 0's second piece: rows 3 and 4


def test_pieces_start_on_eight_rows_so_cublas_runs_its_aligned_kernels():
    """A piece's rows are its matmul output's leading dimension and the offsets of the output gradient's columns:
    llama-1b's gate/up pieces of 1639 rows ran cuBLAS's align1 kernels on an H200, 3-5x slower than aligned ones
    (benchmarks/results/gpu-speed-h200-run12-rtp-rank0-profile.txt). At models' shapes every piece but a chunk's last
    ends on a multiple of 8 rows (`piece_rows` keeps torch.chunk's size only where rounding up would empty a
    piece), the pieces tile the chunk, and no piece passes the budget."""
    import math

    budget = 16_000_000 // 2  # bf16 elements in the ring's 16 MB pieces
    for rows, width in ((16384, 2048), (2048, 8192), (3072, 2048), (128256, 2048), (4099, 64), (1000, 3)):
        for world in (2, 3, 4, 8):
            layout = ChunkLayout((torch.Size((rows, width)),), world)
            pieces = layout.pieces_for(budget)
            for j in range(world):
                start, end = layout.bounds(j)
                cuts = [layout.piece(j, p, pieces) for p in range(pieces)]
                assert cuts[0][0] == start and cuts[-1][1] == end  # the pieces tile the chunk
                assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
                assert all((hi - lo) * width <= max(budget, width) for lo, hi in cuts)
                assert all((hi - start) % 8 == 0 for _, hi in cuts[:-1]), (rows, world, j, cuts)
            assert pieces <= max(1, math.ceil(layout.bounds(0)[1] / max(1, budget // width))) + 1
