"""The ring over NCCL on one GPU (docs/reliability.md, "On GPUs over NCCL"): what the CPU tests of
tests/distributed/test_ring_transports.py show over gloo, here where NCCL's own semantics apply. Runs only in the
NCCL world .ci/gpu chose (NCCL 2.30 or newer, NCCL_MULTI_RANK_GPU_ENABLE=1); skipped in the gloo world, where
the ring stages its hops through host memory and those CPU tests already cover it.

- A world started with no backend (`get_backend()` says 'undefined') gets the "batched" transport, watched: a
  hop of 64 MiB each way at 2 ranks (a send posted alone blocks until the peer's receive is posted, beyond
  NCCL's buffers) arrives whole and in time, and a rotated linear's output and gradients equal vanilla's.
- Walks that disagree (one rank sends weights where the other sends gradients, same shapes: NCCL ignores tags)
  fail with hf_rtp's error on both ranks, from the hop headers.
- A hop nobody answers is named (the neighbour's global rank, HF_RTP_TIMEOUT) within the watch's timeout, while
  the host waits on nothing: NCCL's `work.wait()` does not raise when a peer is gone.
- A first hop whose neighbour never comes: NCCL connects a pair at its first message, and that post blocks the
  host (the H100 run of 2026-11-27 hung there before the watch covered posts). Named, not hung.
- A rank killed mid-walk (`HF_RTP_FAULT=kill@ring.hop#1:40`, as an OOM killer would), in its second step over
  NCCL: the other rank ends with hf_rtp's error naming rank 1, from the watch or the ranks' next meeting.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from gpu_world import NCCL_WORLD, NO_CUDA, join_world
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(100),  # a fixture runs three scenarios, one test may wait out a grace: over --timeout 60
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.skipif(
        os.environ.get("HF_RTP_TEST_BACKEND") != NCCL_WORLD,
        reason="needs the NCCL world (.ci/gpu picks it with NCCL 2.30 or newer); the gloo world's ring is staged",
    ),
]

BIG = 16 * 2**20  # float32 elements: 64 MiB a hop


def _wait_for_failure(ring, seconds: float) -> float:
    started = time.monotonic()
    while ring._watch.failure is None and time.monotonic() - started < seconds:
        time.sleep(0.05)
    return time.monotonic() - started


def _nccl_scenarios():
    """The three scenarios of the docstring, each on a group of its own (a failure aborts its group)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hf_rtp.distributed.tensors.sharding import ChunkLayout
    from hf_rtp.distributed.transport.ring import _GRAD_TAG, _WEIGHT_TAG, Ring
    from hf_rtp.errors import CollectiveMisuseError
    from hf_rtp.layers.linear import _RotatedLinearFn

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # no backend and no device_id: torch's default pair, get_backend() 'undefined' (with device_id it says 'nccl')
    dist.init_process_group(timeout=timedelta(seconds=60))
    rank, out = dist.get_rank(), {"backend": dist.get_backend()}

    ring = Ring(dist.new_group([0, 1]), device=device, timeout_s=30.0)
    out["transport"], out["watched"] = ring.transport, ring._watch is not None
    send = torch.full((BIG,), float(rank + 1), device=device)
    recv = torch.empty_like(send)
    started = time.monotonic()
    ring.exchange([send], [recv], _WEIGHT_TAG).wait()
    torch.cuda.synchronize()
    out["big_hop_s"] = time.monotonic() - started
    out["big_hop"] = (recv.min().item(), recv.max().item())
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(10, 6, generator=gen), torch.randn(10, generator=gen)
    x = torch.randn(3, 4, 6, generator=gen)[rank::2].contiguous().to(device).requires_grad_()
    layout = ChunkLayout((weight.shape, bias.shape), 2)
    lo, hi = layout.bounds(rank)
    w = weight[lo:hi].to(device).requires_grad_()
    b = bias[lo:hi].to(device).requires_grad_()
    y = _RotatedLinearFn.apply(x, w, b, ring, layout)
    y.backward(torch.cos(y.detach()))
    ref_w, ref_b = weight.to(device).requires_grad_(), bias.to(device).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref_y = ref_x @ ref_w.T + ref_b
    ref_y.backward(torch.cos(ref_y.detach()))
    # the other rank's rows of the weight's gradient come from its own batch: compare the input's gradient and
    # the output here; the rows' gradients summed over ranks are checked by tests/gpu/test_training_cuda.py
    out["linear_gap"] = max((y - ref_y).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())
    time.sleep(0.5)  # the watch reads the headers' flag on its own thread
    ring._watch.check()  # matching walks: no mismatch seen

    ring = Ring(dist.new_group([0, 1]), device=device, timeout_s=30.0)
    small, landing = torch.arange(4.0, device=device), torch.empty(4, device=device)
    ring.exchange([small], [landing], _WEIGHT_TAG if rank == 0 else _GRAD_TAG).wait()  # on NCCL: no host wait
    ring.walked()  # a walk's end: its hops' header check goes to the watch
    _wait_for_failure(ring, 20)
    try:
        ring.exchange([small], [landing], _WEIGHT_TAG)
        out["disagreeing"] = None
    except CollectiveMisuseError as err:
        out["disagreeing"] = str(err)
    dist.barrier()

    # the same through the walks, where a hop is one message with its header inside: rank 0's weights against rank
    # 1's gradient accumulator, the same bytes each way
    ring = Ring(dist.new_group([0, 1]), device=device, timeout_s=30.0)
    walk_layout, own = ChunkLayout((torch.Size((4, 3)),), 2), [torch.ones(2, 3, device=device)]
    if rank == 0:
        ring.forward_walk(own, walk_layout, lambda rows, piece: None)
    else:
        ring.backward_walk(own, walk_layout, lambda rows, piece, acc: acc[0].add_(1.0), None)
    out["walk_messages"] = ring.messages
    _wait_for_failure(ring, 20)
    try:
        ring.forward_walk(own, walk_layout, lambda rows, piece: None)
        out["disagreeing_walks"] = None
    except CollectiveMisuseError as err:
        out["disagreeing_walks"] = str(err)
    dist.barrier()

    ring = Ring(dist.new_group([0, 1]), device=device, timeout_s=3.0)
    ring.exchange([small], [landing], _WEIGHT_TAG).wait()  # both ranks: the pair is connected, as after a step
    torch.cuda.synchronize()
    if rank == 0:
        ring.exchange([small], [landing], _WEIGHT_TAG)  # rank 1 never walks this ring again
        out["named_after"] = _wait_for_failure(ring, 30)
        try:
            ring.exchange([small], [landing], _WEIGHT_TAG)
            out["unanswered"] = None
        except CollectiveMisuseError as err:
            out["unanswered"] = str(err)
    dist.barrier()  # the world's group: rank 1 waits here; the aborted ring's group is left as it is
    return out


def _never_connected(stderr_path):
    """Rank 0's first hop on a ring whose neighbour never sends: NCCL connects the pair at that first message and
    the post blocks the host. Rank 1 stays alive and silent (the test kills it once rank 0 reports). Rank 0's
    stderr goes to `stderr_path`, where the watch's last words are if it ends the process."""
    from datetime import timedelta

    import torch.distributed as dist

    from hf_rtp.distributed.transport.ring import _WEIGHT_TAG, Ring
    from hf_rtp.errors import CollectiveMisuseError

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(timeout=timedelta(seconds=60), device_id=device)
    ring = Ring(dist.new_group([0, 1]), device=device, timeout_s=3.0)
    if dist.get_rank() == 1:
        time.sleep(300)
        return None
    with open(stderr_path, "w") as log:
        os.dup2(log.fileno(), 2)  # the watch logs and prints to fd 2
    small, landing = torch.arange(4.0, device=device), torch.empty(4, device=device)
    started = time.monotonic()
    try:
        ring.exchange([small], [landing], _WEIGHT_TAG)
        _wait_for_failure(ring, 30)
        ring.exchange([small], [landing], _WEIGHT_TAG)
        return None, time.monotonic() - started
    except CollectiveMisuseError as err:
        return str(err), time.monotonic() - started


@pytest.fixture(scope="module")
def scenarios():
    return run_on_ranks(_nccl_scenarios, 2, fresh=True, timeout=90, linger_s=5)


def test_a_world_without_a_backend_walks_batched_over_nccl_beyond_its_buffers(scenarios):
    for rank, out in enumerate(scenarios):
        assert out["backend"] == "undefined" and out["transport"] == "batched" and out["watched"], out
        peer = float(2 - rank)  # the other rank's fill: rank + 1
        assert out["big_hop"] == (peer, peer), (rank, out["big_hop"])
        assert out["big_hop_s"] < 20, out["big_hop_s"]
        assert out["linear_gap"] < 1e-4, (rank, out["linear_gap"])


def test_walks_that_disagree_fail_by_name_on_both_ranks_over_nccl(scenarios):
    for out in scenarios:
        message = out["disagreeing"]
        assert message is not None and "walked it differently" in message, message
        assert out["walk_messages"] == 2, out["walk_messages"]  # a walk's hop: one send, one receive, header inside
        message = out["disagreeing_walks"]
        assert message is not None and "walked it differently" in message, message


def test_a_hop_nobody_answers_over_nccl_is_named_within_the_timeout(scenarios):
    out = scenarios[0]
    assert out["unanswered"] is not None and "HF_RTP_TIMEOUT" in out["unanswered"], out["unanswered"]
    assert "global rank 1" in out["unanswered"], out["unanswered"]
    assert 3.0 <= out["named_after"] < 20.0, out["named_after"]


def test_a_first_hop_whose_neighbour_never_comes_is_named_not_hung(tmp_path):
    """Either the abort unblocks the post and the ring raises hf_rtp's error (what the H100 did), or the watch ends
    the process with it printed after its grace (30 s): within the timeout and the grace, with hf_rtp's words."""
    stderr_path = tmp_path / "rank0.stderr"
    started = time.monotonic()
    try:
        ran = run_on_ranks(_never_connected, 2, str(stderr_path), fresh=True, timeout=90, survivors=(0,), linger_s=5)
        message, after = ran[0]
    except RuntimeError as err:  # rank 0 ended by the watch: its last words are in its stderr
        assert "exited without a result" in str(err), err
        message, after = stderr_path.read_text(), time.monotonic() - started
        assert "hf_rtp: ending this process" in message, message[-3000:]
    print(stderr_path.read_text()[-2000:])  # the log's record of what rank 0 said
    assert message is not None and "still not posted" in message and "global rank 1" in message, message[-3000:]
    assert after < 90, after


def _killed_mid_training(ckpt, stderr_path):
    """Steps of a rotated Llama on cuda:0 over NCCL; rank 1 is killed between two hops of a walk (HF_RTP_FAULT at
    "ring.hop", its 40th: in the second step), where rank 0 has hops in flight to it. Rank 0: (the step that
    failed, seconds from that step's start to the error, the error); its stderr in `stderr_path`."""
    import hf_rtp

    device = join_world()
    rank = torch.distributed.get_rank()
    if rank == 0:
        with open(stderr_path, "w") as log:
            os.dup2(log.fileno(), 2)
    model = hf_rtp.from_pretrained(ckpt, device=device, dtype=torch.float32, timeout=8).train()
    ids = global_batch(2)[rank].to(device)
    for step in range(3):
        started = time.monotonic()
        try:
            model(ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
        except hf_rtp.CollectiveMisuseError as err:
            return step, time.monotonic() - started, str(err)
    return None, None, None


def test_a_rank_killed_mid_walk_over_nccl_ends_the_other_with_hf_rtps_error(tmp_path):
    """Over NCCL nothing closes when a rank on the same node dies: rank 0's hops stay in flight. It must end with
    hf_rtp's error naming rank 1, from whichever comes first: the watch (the timeout given, 8 s, and the abort),
    or the next meeting of the ranks at a forward or backward (gloo, which sees the process gone)."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    stderr_path = tmp_path / "rank0.stderr"
    env = {"HF_RTP_FAULT": "kill@ring.hop#1:40"}
    try:
        ran = run_on_ranks(
            _killed_mid_training, 2, ckpt, str(stderr_path), env=env, fresh=True, timeout=90, survivors=(0,), linger_s=5
        )
        step, seconds, message = ran[0]
    except RuntimeError as err:  # rank 0 ended by the watch after its grace: its last words are in its stderr
        assert "exited without a result" in str(err), err
        step, seconds, message = None, None, stderr_path.read_text()
        assert "hf_rtp: ending this process" in message, message[-3000:]
    print(f"step {step}, {seconds} s: {message}\n{stderr_path.read_text()[-2000:]}")  # which path named it
    assert message is not None and "rank 1" in message, message[-3000:]
    assert step != 0, "rank 1 died in the first step: the hop count no longer lands in the second"
    assert seconds is None or seconds < 8 + 20, seconds
