"""What one hop of the ring costs with two ranks on one GPU, beside the collectives DDP and FSDP2 make there.

On one H100 shared by two ranks over NCCL (benchmarks/results/gpu-check-h100-run8-nccl.log), a step of the 90M
Llama took RTP 0.372 s against DDP's 0.058 s and FSDP2's 0.068 s, over 79 hops: about 4 ms a hop. FSDP2 makes
about 21 collectives a step (an all-gather per unit in forward and in backward, a reduce-scatter per unit; 6 layers
and the root). Two explanations fit: a point-to-point exchange between two processes that take turns on one GPU
costs a time slice where a collective does not, or the ring adds host work per hop on CUDA (its header, the watch,
the flag it copies to the host). This separates them. Its first run (benchmarks/results/hop-latency-h100.json)
found neither as put: an all-gather waited for alone also costs one time slice (2.26 ms), as a bare hop does, and
the host's share of a hop is small (0.40 ms watched); the ring's watched hop costs two slices, its header and watch
together. So FSDP2's 21 collectives, waited for one by one, would take 47 ms: its step, 10 ms above DDP's, shows
that it does not wait for them one by one (they run on their own streams, ahead of the layers that use them).
Each case makes `--hops` messages one after the other, each waited for before the next is posted, as a walk does:

- p2p: `dist.batch_isend_irecv` of one send to the next rank and one receive from the previous (what the ring
  posts on NCCL), bare;
- p2p+header: the same with a second, 16-byte message each way in the same batch, as a watched hop's header
  (so that the header's cost is told from the watch's: the ring cases remove both together);
- ring: `Ring.exchange` as a rotated layer's walk posts it on NCCL (pool slots, the header inside the message, the
  watch, the header check a walk makes at its end; watched over gloo too);
- ring-unwatched: `Ring.exchange` without the header and the watch;
- all-gather: `all_gather_into_tensor` with each rank giving the bytes a hop sends (FSDP2's collective);
- all-reduce: of the bytes a hop sends (DDP's).

Per case and message size: milliseconds per message of wall time (the device synchronised after the last), and
of host time to post and wait (`time.perf_counter` before the device is synchronised: near the wall time means
the host blocked on every message). The cases take turns round by round, in an order reversed every other round,
and each figure is the median over rounds. Prints a table of every case per size and its ratio to the all-gather,
and writes the figures as JSON.

    python benchmarks/hop_latency_cuda.py --output benchmarks/results/hop-latency-h100.json   # cuda:0, NCCL
    python benchmarks/hop_latency_cuda.py --device cpu --hops 5 --rounds 2                     # its own check, gloo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

CASES = ("p2p", "p2p+header", "ring", "ring-unwatched", "all-gather", "all-reduce")
# 64 KiB: latency alone; 3 MiB: the 90M Llama's mean hop (230 MB over 79 hops a step); 16 MiB: a whole piece
SIZES = (64 << 10, 3 << 20, 16 << 20)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _case(name: str, size: int, device: torch.device, rings: dict):
    """A function making one message of `name` at `size` bytes, waited for as a walk waits for its hop."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = size // 4
    send = torch.full((numel,), float(rank), device=device)
    recv = torch.empty(numel, device=device)
    if name in ("ring", "ring-unwatched"):
        # as a walk at 2 ranks: its own piece sent from the pool's slot 1, the neighbour's received into slot 0 (a
        # watched hop is then one message, its header inside), the walk's end (its header check) after each hop
        ring = rings[name]
        (out,) = ring.pool.take("weights", 1, [send.shape], send)
        (into,) = ring.pool.take("weights", 0, [recv.shape], recv)
        out.copy_(send)

        def hop() -> None:
            ring.exchange([out], [into], 0).wait()
            ring.walked()

        return hop
    if name == "all-gather":
        out = torch.empty(numel * world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return lambda: gather(out, send, async_op=True).wait()
    if name == "all-reduce":
        return lambda: dist.all_reduce(send, async_op=True).wait()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    pairs = [(send, recv)]
    if name == "p2p+header":
        pairs.append(
            (torch.zeros(2, dtype=torch.int64, device=device), torch.empty(2, dtype=torch.int64, device=device))
        )
    if device.type == "cuda":  # NCCL: posted together, as the ring does (its "batched" transport)

        def p2p() -> None:
            ops = [dist.P2POp(dist.isend, s, nxt) for s, _ in pairs] + [
                dist.P2POp(dist.irecv, r, prv) for _, r in pairs
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return p2p

    def pair() -> None:  # gloo: one by one (its batched path has been seen to hang: distributed/transport/ring.py)
        for s, r in pairs:
            for work in (dist.isend(s, nxt), dist.irecv(r, prv)):
                work.wait()

    return pair


def _time(make, hops: int, device: torch.device) -> tuple[float, float]:
    """(wall, host) seconds per message over `hops` messages after the device was idle."""
    _sync(device)
    dist.all_reduce(torch.zeros(1, device=device))  # the ranks start together (barrier's device is not the case's)
    _sync(device)
    began = time.perf_counter()
    for _ in range(hops):
        make()
    host = time.perf_counter() - began
    _sync(device)
    wall = time.perf_counter() - began
    return wall / hops, host / hops


def _rank(rank: int, world: int, port: int, args: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from hf_rtp.distributed.transport.ring import Ring

    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args["backend"], timeout=timedelta(seconds=120))
    try:
        group = dist.new_group(list(range(world)))
        rings = {
            "ring": Ring(group, device=device, timeout_s=60.0, watched=True),  # as on NCCL, over gloo too
            "ring-unwatched": Ring(group, device=device, timeout_s=60.0, watched=False),
        }
        figures: dict = {}
        for size in args["sizes"]:
            makes = {name: _case(name, size, device, rings) for name in CASES}
            for make in makes.values():  # NCCL connects a pair at its first message: not timed
                make()
            per: dict = {name: ([], []) for name in CASES}
            for r in range(args["rounds"]):
                for name in CASES if r % 2 == 0 else reversed(CASES):
                    wall, host = _time(makes[name], args["hops"], device)
                    per[name][0].append(wall)
                    per[name][1].append(host)
            figures[size] = {n: (statistics.median(w), statistics.median(h)) for n, (w, h) in per.items()}
        results.put((rank, figures, rings["ring"].transport))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(results, procs: list, timeout: float) -> list:
    """Every rank's figures; a rank that exits without them ends the wait at once, naming it (not `timeout`
    seconds later: on a lent GPU those are device minutes)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        delivered = {item[0] for item in got}  # a rank may fail in its teardown after its figures: still a result
        dead = [
            f"rank {r} (exit code {p.exitcode})"
            for r, p in enumerate(procs)
            if p.exitcode not in (None, 0) and r not in delivered
        ]
        if dead:
            raise SystemExit(f"hop_latency_cuda.py: {', '.join(dead)} ended without its figures (see its output above)")
        if time.monotonic() > deadline:
            raise SystemExit(f"hop_latency_cuda.py: no figures from every rank after {timeout:.0f} s (--timeout)")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="every rank's device (default cuda:0: one shared GPU)")
    parser.add_argument("--backend", default=None, help="default: cpu:gloo,cuda:nccl on CUDA, gloo on the CPU")
    parser.add_argument("--hops", type=int, default=40, help="messages per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes each rank sends per message")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before the ranks are killed")
    parser.add_argument("--output", default=None, help="JSON file for the figures")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("hop_latency_cuda.py: no CUDA device here (--device cpu runs it over gloo)")
    backend = args.backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    if cuda and "nccl" in backend:
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # two ranks on one GPU: NCCL 2.30 or newer
    settings = dict(
        device=args.device,
        backend=backend,
        hops=args.hops,
        rounds=args.rounds,
        sizes=[int(s) for s in args.sizes.split(",")],
    )
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child of a process that started it
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, settings, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = _collect(results, procs, args.timeout)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    got.sort(key=lambda item: item[0])
    transport = got[0][2]
    print(f"two ranks on {args.device} over {backend} (the ring's transport: {transport})")
    print("milliseconds per message, the slower rank's; host: posting and waiting, before the device is synchronised")
    print(f"{'bytes':>10} {'case':<15} {'wall ms':>9} {'host ms':>9} {'/ all-gather':>13}")
    table: dict = {}
    for size in settings["sizes"]:
        worst = {n: tuple(max(g[1][size][n][i] for g in got) for i in (0, 1)) for n in CASES}
        for name in CASES:
            wall, host = worst[name]
            ratio = wall / worst["all-gather"][0]
            print(f"{size:>10} {name:<15} {wall * 1e3:>9.3f} {host * 1e3:>9.3f} {ratio:>12.2f}x")
        table[size] = {n: {"wall_ms": w * 1e3, "host_ms": h * 1e3} for n, (w, h) in worst.items()}
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"settings": settings, "transport": transport, "ms_per_message": table}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
