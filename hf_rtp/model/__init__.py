"""What a rotated model is made of and carries: its state, its rotated modules, ties, the fused head, generation
and the data-parallel glue (DESIGN.md)."""
