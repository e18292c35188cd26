"""torch.distributed only, never transformers (DESIGN.md): three folders, one job each. `transport/` moves the
ring's messages (the only folder that does point-to-point communication), `ranks/` makes ranks agree (groups,
meetings, shared failures, topology), `tensors/` says what a rotated tensor's rows mean."""
