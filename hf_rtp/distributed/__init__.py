"""torch.distributed only, never transformers: the chunking rule, the ring, rotated tensors, groups, rendezvous,
agreement and the rings' topology (DESIGN.md)."""
