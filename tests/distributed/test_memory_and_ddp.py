"""Per-rank memory shape (1/N of parameters, gradients, optimizer state; at most two foreign chunks)
and DDP interplay (DDP leaves rotated parameters to the ring and averages the rest)."""

import os

import pytest
import torch
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

from hf_rtp.distributed.transport.pool import HEADROOM


def _rank_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _ddp_and_shares(ckpt):
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_rtp
    from hf_rtp.distributed.tensors.sharding import chunk_rows

    rank, world = _rank_world()
    batch = global_batch(world)[rank]
    plain = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    wrapped = DDP(hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train())
    plain(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(plain)
    wrapped(input_ids=batch, labels=batch).loss.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), wrapped.module.named_parameters(), strict=True):
        assert type(p.grad) is type(q.grad), name
        if isinstance(p, DTensor):  # untouched by DDP: the ring's result, bit for bit
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
        else:  # DDP's bucketed mean against ours
            torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    # What this rank holds: rotated parameters' own chunk only, replicated ones whole.
    params = list(plain.parameters())
    total = sum(p.numel() for p in params)
    replicated = sum(p.numel() for p in params if not isinstance(p, DTensor))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    expected = replicated + sum(
        (lambda r: (r[1] - r[0]) * p[0].numel())(chunk_rows(p.shape[0], world, rank))
        for p in params
        if isinstance(p, DTensor)
    )
    assert local == expected
    grads_local = sum((p.grad.to_local() if isinstance(p, DTensor) else p.grad).numel() for p in params)
    assert grads_local == local
    torch.optim.AdamW(params, lr=1e-3).step()
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    state_local = sum(
        (s.to_local() if isinstance(s, DTensor) else s).numel()
        for st in opt.state.values()
        for k, s in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    assert state_local == 2 * local
    return local / total, replicated / total


def test_ddp_matches_sync_grads_and_rank_holds_its_share(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt", hidden_size=64, intermediate_size=96, vocab_size=1001)
    world = 2
    shares = run_on_ranks(_ddp_and_shares, world, ckpt)
    for local_share, replicated_share in shares:
        # about 1/N: the rotated part is split evenly up to one row, plus the small replicated norms
        assert abs(local_share - (1 - replicated_share) / world - replicated_share) < 0.01
        assert local_share < 0.52


def _count_live_chunks(ckpt, out, piece_size):
    import hf_rtp
    from hf_rtp.distributed.tensors.sharding import StackedLayout

    rank, world = _rank_world()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, rotation_piece_size=piece_size).train()
    ring = hf_rtp.state_of(model).topology.ring

    # Spy on what each rotated op's compute step receives: which foreign chunks it ever holds.
    foreign_per_op, walk = [], ring.forward_walk

    def spying_walk(own, layout, compute, **kwargs):
        storages = set()

        def record(rows, chunk):
            storage = chunk[0].untyped_storage().data_ptr()
            if storage != own[0].untyped_storage().data_ptr():
                storages.add(storage)
            compute(rows, chunk)

        walk(own, layout, record, **kwargs)
        foreign_per_op.append(storages)

    ring.forward_walk = spying_walk
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    batch = global_batch(world)[rank]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()

    weight_buffers = ring.pool.buffers("weights")
    pool = {b.untyped_storage().data_ptr() for b in weight_buffers}
    layouts = [m.layout for m in model.modules() if hasattr(m, "layout")]
    # q/k/v and gate/up walk stacked (layers/siblings.py's STACKED): one walk, of their layouts stacked, for each set
    groups = {id(m.siblings): m.siblings for m in model.modules() if "siblings" in vars(m)}
    stacked = {(g, tuple(sorted([i, *others]))) for g in groups.values() for i, others in g.stacked.items()}
    walks = len(layouts) - sum(len(members) - 1 for _, members in stacked)
    layouts += [StackedLayout.of(tuple(g.members[i].layout for i in members)) for g, members in stacked]
    largest = max(layout.max_piece_numel(ring.pieces(layout, model.lm_head.weight)) for layout in layouts)
    # float32 slots, each with room for a watched hop's header after its piece
    assert len(weight_buffers) == 2 and all(b.nbytes == largest * 4 + HEADROOM for b in weight_buffers)
    if piece_size != "16MB":  # slots hold a piece, far less than the largest chunk (the embedding's)
        assert largest * 4 <= ring.piece_bytes < 4 * max(layout.max_numel() for layout in layouts)
    assert ring.pool.allocations == 4  # two weight and two gradient slots, sized once, never regrown
    assert len(ring.pool.buffers("grads")) == 2
    assert stacked and len(foreign_per_op) == walks
    assert all(len(s) == world - 1 and s <= pool for s in foreign_per_op)  # N-1 = 2 chunks, both pool slots
    assert not saved & pool, "a foreign chunk was kept for backward"
    model.save_pretrained(out)  # chunks stream to rank 0 through the same two weight slots
    assert ring.pool.allocations == 4
    return len(foreign_per_op)


@pytest.mark.parametrize("piece_size", ["16MB", "2KB"])
def test_rotated_op_holds_at_most_two_foreign_chunks(tmp_path, piece_size):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    ops = run_on_ranks(_count_live_chunks, 3, ckpt, str(tmp_path / "out"), piece_size)
    assert ops[0] == 2 * 4 + 2  # per layer 7 projections in 4 walks (q/k/v and gate/up stacked), embedding, LM head
