"""Rotated tensors' semantics: which rows a rank holds and what an op on them means. One module a job:

- `sharding`: the one sharding rule, cut like `torch.chunk` (DESIGN.md I2); `StackedLayout`, several tensors'
  chunks walked as one;
- `rotated`: `RotatedTensor` and `RotationMesh`, DTensors with data-parallel semantics (DESIGN.md I4);
- `row_edits`: users' assignments into a rotated tensor's rows land on the ranks that hold them; an in-place op
  on gathered rows is refused;
- `replicas`: the sum over a 2-D grid's replicas, after autograd accumulates `.grad`;
- `blockwise`: bitsandbytes' 8-bit optimizer state on rotated rows: block alignment, the block scales as a
  rotated tensor, its update ops run on each rank's rows;
- `sequence`: how one sequence is cut across a ring for context parallelism: chunks r and 2N-1-r of 2N.
"""
