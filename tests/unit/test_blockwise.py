"""hf_rtp/distributed/tensors/blockwise.py: which rotated tensors may keep bitsandbytes' blockwise 8-bit state, the
shape of their block scales, and which ops run on a rank's rows.

`aligned` is checked against a brute-force oracle written from the definition: walk every element of the
flattened tensor, note which rank holds it and which block it falls in; the tensor is aligned when every block
is one rank's alone and each rank's rows of the scales (cut like any rotated tensor, by chunk_rows) hold exactly
the blocks of its rows. BLOCK is checked against what bitsandbytes itself allocates."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rtp.distributed.tensors.blockwise import BLOCK, STEPPED, aligned, scales_shape, step_rows
from hf_rtp.distributed.tensors.sharding import chunk_rows
from hf_rtp.errors import RotatedStateError


def _oracle(shape, world, block):
    rows, per_row = shape[0], math.prod(shape[1:])
    if per_row == 0:
        return False
    owner: dict[int, set[int]] = {}  # block -> the ranks holding one of its elements
    blocks_of = {r: set() for r in range(world)}
    for r in range(world):
        start, end = chunk_rows(rows, world, r)
        for element in range(start * per_row, end * per_row):
            owner.setdefault(element // block, set()).add(r)
            blocks_of[r].add(element // block)
    if any(len(ranks) > 1 for ranks in owner.values()):
        return False  # a block straddles two ranks
    scale_rows, per_scale_row = scales_shape(shape, block)
    total = len(owner)
    for r in range(world):
        lo, hi = chunk_rows(scale_rows, world, r)
        held = set(range(lo * per_scale_row, min(hi * per_scale_row, total)))
        if held != blocks_of[r]:
            return False
    return True


SHAPES = [(r, c) for r in (1, 3, 4, 7, 8, 12, 16, 33) for c in (1, 2, 3, 4, 6, 8, 16, 24)] + [
    (5, 2, 4),
    (6, 3, 2),
    (9, 0),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_aligned_agrees_with_a_walk_over_every_element(world):
    block = 16  # small blocks, the same arithmetic as BLOCK's, so that the walk stays short
    wrong = [s for s in SHAPES if aligned(s, world, block) != _oracle(s, world, block)]
    assert not wrong, wrong
    assert any(aligned(s, world, block) for s in SHAPES)
    assert world == 1 or not all(aligned(s, world, block) for s in SHAPES)  # the walk sees both answers


@pytest.mark.parametrize(
    "shape, world, expected",
    [
        ((4096, 4096), 8, True),  # a Llama-3-8B projection: a row is 16 blocks, any cut of rows is aligned
        ((128256, 4096), 3, True),
        ((14336, 4096), 7, True),
        ((64, 64), 2, True),  # 4 rows a block, 32 rows a rank: 8 blocks each
        ((10, 64), 2, False),  # rank 1 starts at row 5, inside the block of rows 4-7
        ((512,), 2, True),  # a bias: 256 elements each, one block each
        ((100,), 2, False),  # rank 1 starts at element 50 of the only block
        ((100,), 1, True),
    ],
)
def test_aligned_at_bitsandbytes_block_size(shape, world, expected):
    assert aligned(shape, world) is expected
    if math.prod(shape) < 10**5:  # the walk, where it is short
        assert _oracle(shape, world, BLOCK) is expected


@pytest.mark.parametrize("shape", [(4096, 4096), (10, 100), (3, 7), (1000,), (5, 2, 4), (513, 96)])
def test_the_scales_hold_one_float_per_block_with_less_than_one_row_to_spare(shape):
    rows, per_scale_row = scales_shape(shape)
    blocks = math.ceil(math.prod(shape) / BLOCK)
    assert (rows - 1) * per_scale_row < blocks <= rows * per_scale_row
    # a scale row is the fewest whole parameter rows that are also whole blocks: lcm(row, BLOCK) elements
    assert per_scale_row * BLOCK == math.lcm(math.prod(shape[1:]), BLOCK)
    assert scales_shape(shape) == scales_shape(shape)  # no world size in it: saved by N ranks, loaded by M


def test_scales_shape_of_a_llama_projection_worked_by_hand():
    # 4096 elements a row are 16 blocks of 256: one scale row per parameter row, 16 scales wide
    assert scales_shape((4096, 4096)) == (4096, 16)
    # 100 elements a row: gcd(100, 256) = 4, so 64 rows (6400 elements) make 25 whole blocks;
    # 10 rows fit in one such group: 1 scale row of 25 (only ceil(1000 / 256) = 4 of them used)
    assert scales_shape((10, 100)) == (1, 25)


def test_an_op_that_is_not_an_update_bitsandbytes_steps_row_by_row_is_refused_by_its_name():
    x = torch.zeros(2)
    with pytest.raises(RotatedStateError, match="bitsandbytes' add on a rotated parameter: hf_rtp does not run"):
        step_rows(torch.ops.aten.add.Tensor, (x, x), {})
    assert set(STEPPED) == {"optimizer_update_8bit_blockwise", "optimizer_update_32bit"}


def test_bitsandbytes_ops_are_mapped_by_their_schemas_names_and_its_block_is_256():
    bnb = pytest.importorskip("bitsandbytes")
    # BLOCK is bitsandbytes' own: a real 8-bit Adam keeps one absmax per 256 elements
    p = torch.nn.Parameter(torch.randn(64, 16))
    optimizer = bnb.optim.Adam8bit([p], min_8bit_size=0)
    p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.state[p]["absmax1"].numel() == math.ceil(p.numel() / BLOCK)

    ops = torch.ops.bitsandbytes
    for name in STEPPED:  # each stepped name is an op bitsandbytes registers
        assert hasattr(ops, name)
    g = torch.zeros(8)
    # the name passed its check and the arguments were bound by the schema's names: the parameter `p` (not a
    # rotated one here) and `max_unorm` (LAMB, LARS) are found whether passed by position or by keyword
    with pytest.raises(RotatedStateError, match="its state is rotated but the parameter is not"):
        step_rows(ops.optimizer_update_32bit.default, ("adam", g, g.clone(), g.clone()), {"max_unorm": 0.0})
    with pytest.raises(RotatedStateError, match=r"max_unorm \(LAMB, LARS\) bounds the update by the whole tensor"):
        step_rows(ops.optimizer_update_32bit.default, ("adam", g, g, g, None, None, 1.0, 0.0), {})
    with pytest.raises(RotatedStateError, match="max_unorm"):
        step_rows(ops.optimizer_update_32bit.default, ("adam", g, g, g), {"max_unorm": 0.5})
