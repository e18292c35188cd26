"""The ring's transports over real gloo processes: what NCCL and a GPU world over gloo need, shown where a CPU can.

- "staged" (a backend that cannot send the device's tensors point to point: gloo on GPUs) copies every message
  through host memory; on CPU tensors the copies are real copies, so a staged ring must give bit for bit what
  the plain one gives: a rotated linear's output and every gradient, and a save's gathered rows.
- a "watched" ring (NCCL's, distributed/transport/watch.py) sends no tags, as NCCL ignores them, and puts a header on
  every hop instead; over gloo it too must give the plain ring's results bit for bit. Ranks whose walks disagree (one
  sends weights where the other sends gradients, same shapes: tags would have kept them apart) fail by name on
  both ranks, from the headers alone; a hop a neighbour never answers is named within the watch's timeout
  while the rank waits on nothing (NCCL's waits do not block the host).
- a world started with no backend (get_backend() says 'undefined') trains like vanilla transformers.
"""

from __future__ import annotations

import time

import torch
from support.spawn import run_on_ranks


def _linear_through(ring):
    """A rotated linear's output and gradients at 2 ranks (float64), and a save's gathered weight on rank 0."""
    from hf_rtp.distributed.tensors.sharding import ChunkLayout
    from hf_rtp.layers.linear import _RotatedLinearFn

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(10, 6, generator=gen, dtype=torch.float64), torch.randn(10, generator=gen).double()
    x = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)[ring.rank :: 2].contiguous()
    layout = ChunkLayout((weight.shape, bias.shape), ring.size)
    lo, hi = layout.bounds(ring.rank)
    w, b = weight[lo:hi].clone().requires_grad_(), bias[lo:hi].clone().requires_grad_()
    x.requires_grad_()
    out = _RotatedLinearFn.apply(x, w, b, ring, layout)
    out.backward(torch.cos(out.detach()))
    # each piece copied before the next is asked for, as a save writes it: the next lands in its slot
    gathered = [piece.clone() for piece in ring.collect(w.detach(), ChunkLayout((weight.shape,), ring.size))]
    expected = x.detach() @ weight.T + bias
    # as lists: a tensor sent through the results queue is shared memory its rank takes away when it exits
    return {
        "out": out.detach().tolist(),
        "vanilla_gap": (out.detach() - expected).abs().max().item(),
        "grads": [g.tolist() for g in (x.grad, w.grad, b.grad)],
        "gathered": torch.cat(gathered).tolist() if gathered else None,
        "whole": weight.tolist(),
    }


def _transports():
    import torch.distributed as dist

    from hf_rtp.distributed.transport.ring import Ring

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], backend="gloo")
    out = {}
    for name, kwargs in [("plain", {}), ("staged", {"transport": "staged"}), ("watched", {"watched": True})]:
        ring = Ring(group, piece_bytes=128, timeout_s=30.0, **kwargs)  # 128 B: several pieces per chunk
        assert ring.transport == kwargs.get("transport", "plain")
        out[name] = _linear_through(ring)
        if name == "watched":
            time.sleep(1.0)  # the watch reads the headers' flag on its own thread
            ring._watch.check()  # no mismatch was seen on matching walks
    return out


def test_staged_and_watched_rings_give_the_plain_rings_results_bit_for_bit():
    for rank, result in enumerate(run_on_ranks(_transports, 2)):
        plain = result["plain"]
        assert plain["vanilla_gap"] < 1e-12
        for name in ("staged", "watched"):
            other = result[name]
            assert other["out"] == plain["out"], (rank, name)  # lists of floats: equal bit for bit
            assert other["grads"] == plain["grads"], (rank, name)
            if rank == 0:
                assert other["gathered"] == plain["whole"], name
        if rank == 0:
            assert plain["gathered"] == plain["whole"]


def _disagreeing_walks():
    import torch.distributed as dist

    from hf_rtp.distributed.transport.ring import _GRAD_TAG, _WEIGHT_TAG, Ring
    from hf_rtp.errors import CollectiveMisuseError

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], backend="gloo")
    ring = Ring(group, timeout_s=30.0, watched=True)
    send, recv = torch.arange(4.0), torch.empty(4)
    # The same shapes, other kinds: over NCCL (no tags) these match and the values would be read as the other's.
    ring.exchange([send], [recv], _WEIGHT_TAG if ring.rank == 0 else _GRAD_TAG).wait()
    ring.walked()  # a walk's end: its hops' header checks go to the watch (every walk of the ring's calls it)
    deadline = time.monotonic() + 20
    while ring._watch.failure is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        ring.exchange([send], [recv], _WEIGHT_TAG)
    except CollectiveMisuseError as err:
        return str(err)
    return None


def test_walks_that_disagree_fail_by_name_on_every_rank_without_tags():
    for message in run_on_ranks(_disagreeing_walks, 2):
        assert message is not None and "walked it differently" in message, message
        assert "gradients" in message or "weights" in message, message


def _disagreeing_walks_of_one_message():
    """The same, through the walks themselves, where a hop is one message with its header inside: rank 0 walks a
    forward (its weights travel), rank 1 a backward of the same layout with no input gradient (only its gradient
    accumulator travels): a message of the same size each way, read as the other kind over NCCL."""
    import torch.distributed as dist

    from hf_rtp.distributed.tensors.sharding import ChunkLayout
    from hf_rtp.distributed.transport.ring import Ring
    from hf_rtp.errors import CollectiveMisuseError

    dist.init_process_group("gloo")
    ring = Ring(dist.new_group([0, 1], backend="gloo"), timeout_s=30.0, watched=True)
    layout = ChunkLayout((torch.Size((4, 3)),), 2)
    own = [torch.ones(2, 3)]
    if ring.rank == 0:
        ring.forward_walk(own, layout, lambda rows, piece: None)
    else:
        ring.backward_walk(own, layout, lambda rows, piece, acc: acc[0].add_(1.0), None)
    messages = ring.messages
    deadline = time.monotonic() + 20
    while ring._watch.failure is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        ring.forward_walk(own, layout, lambda rows, piece: None)
    except CollectiveMisuseError as err:
        return str(err), messages
    return None, messages


def test_walks_that_disagree_fail_by_name_when_a_hop_is_one_message():
    for message, messages in run_on_ranks(_disagreeing_walks_of_one_message, 2):
        assert messages == 2  # the hop: one send, one receive, the header inside
        assert message is not None and "walked it differently" in message, message
        assert "global rank" in message and ("gradients" in message or "weights" in message), message


def _unanswered_hop():
    import torch.distributed as dist

    from hf_rtp.distributed.transport.ring import _WEIGHT_TAG, Ring
    from hf_rtp.errors import CollectiveMisuseError

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], backend="gloo")
    ring = Ring(group, timeout_s=2.0, watched=True)
    send, recv = torch.arange(4.0), torch.empty(4)
    message = None
    if ring.rank == 0:
        pending = ring.exchange([send], [recv], _WEIGHT_TAG)  # rank 1 is not walking: nothing arrives
        started = time.monotonic()
        while ring._watch.failure is None and time.monotonic() - started < 20:
            time.sleep(0.1)
        named_after = time.monotonic() - started
        try:
            ring.exchange([send], [recv], _WEIGHT_TAG)
        except CollectiveMisuseError as err:
            message = str(err)
        dist.barrier()  # now rank 1 answers the first hop, so both ranks end cleanly
        pending.wait()
        return message, named_after
    dist.barrier()
    Ring(group, watched=True).exchange([send], [recv], _WEIGHT_TAG).wait()  # a fresh ring: its count matches
    return None


def test_a_hop_nobody_answers_is_named_within_the_timeout_while_nothing_waits():
    message, named_after = run_on_ranks(_unanswered_hop, 2)[0]
    assert message is not None and "HF_RTP_TIMEOUT" in message and "global rank 1" in message, message
    assert 2.0 <= named_after < 15.0


def _undefined_world(ckpt):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    dist.init_process_group()  # no backend: get_backend() says 'undefined'
    assert dist.get_backend() == "undefined"
    model = hf_rtp.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss, expected = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    from hf_rtp.model.state import state_of

    return state_of(model).topology.ring.transport, abs(loss.item() - expected.item())


def test_a_world_started_without_a_backend_gets_a_working_ring(tmp_path):
    from support.models import make_tiny_llama

    ckpt = make_tiny_llama(tmp_path)
    for transport, gap in run_on_ranks(_undefined_world, 2, ckpt):
        assert transport == "plain" and gap < 1e-12, (transport, gap)
