import pytest
import torch

from hf_rtp.sharding import ChunkLayout, chunk_rows


@pytest.mark.parametrize("n", [0, 1, 2, 5, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_chunk_rows_cut_like_torch_chunk(n, world):
    pieces = torch.chunk(torch.arange(n), world) if n else ()
    expected = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    got = [chunk_rows(n, world, j) for j in range(world)]
    assert [g for g in got if g[1] > g[0]] == expected
    assert got[0][0] == 0 and got[-1][1] == n  # every row covered once, in order
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_layout_bundles_weight_and_bias():
    layout = ChunkLayout((torch.Size([10, 4]), torch.Size([10])), 3)
    assert layout.shapes(2) == [torch.Size([2, 4]), torch.Size([2])]
    assert layout.max_numel() == 4 * 4 + 4
    with pytest.raises(ValueError, match="share dim 0"):
        ChunkLayout((torch.Size([10, 4]), torch.Size([9])), 3)
