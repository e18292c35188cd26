"""model/context/inputs.py's checks of a block's buffers, in one process: what each rank decides before the ranks
compare their decisions at the block's entry (tests/distributed/test_context_parallel_seams.py runs them on ranks)."""

from __future__ import annotations

import torch

from hf_rtp.model.context.inputs import _documents, buffer_problem


def test_one_tensor_listed_twice_is_fine_and_cut_once_along_one_dim():
    ids = torch.zeros(2, 9, dtype=torch.long)
    assert buffer_problem([ids, ids, torch.zeros(2, 9)], [1, 1, 1]) is None
    assert "again, cut along another dim" in buffer_problem([ids, ids], [1, 0])


def test_views_of_one_storage_and_lengths_that_differ_are_named():
    ids = torch.zeros(2, 9, dtype=torch.long)
    assert "buffers 0 and 2 are different tensors sharing storage" in buffer_problem(
        [ids, torch.ones(2, 9), ids[:, :]], [1, 1, 1]
    )
    assert "differ in length: (2, 9) (dim 1), (2, 8) (dim 1)" in buffer_problem([ids, torch.ones(2, 8)], [1, 1])


def test_counts_dims_and_types_are_checked_before_anything_is_cut():
    ids = torch.zeros(2, 9)
    assert buffer_problem([ids], [1, 1]) == "1 buffers but 2 buffer_seq_dims"
    assert "no buffers" in buffer_problem([], [])
    assert "buffer_seq_dims[0] = 2 is not one of them" in buffer_problem([ids], [2])
    assert "is a list, not a tensor" in buffer_problem([[1, 2]], [0])
    assert buffer_problem([ids], [-1]) is None  # a negative dim, as torch takes it


def test_packed_documents_start_where_positions_restart():
    whole = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert _documents(whole) == ((0, 3, 5), (0,))
    assert _documents(torch.arange(6)[None]) is None
