"""What a message costs over gloo between processes on this machine: the constants of `hf-rtp estimate --speed
--hardware cpu` (hf_rtp/tools/speed.py) that a bench step does not give apart from the step itself.

At each world size, one torch thread per rank (as `hf-rtp bench` runs them), the fastest of `--reps` after one warm-up
(timeit's convention: the machine is shared, and the least disturbed run is the link's own; the medians are kept
beside them, `*_median_s`):
- a ring hop as hf_rtp's ring posts it on gloo (the group's own send to the next rank and receive from the previous
  one, then waits), of 8 bytes (its wall time: a message's latency and host time together) and of `--bytes`
  (bandwidth: bytes over the time beyond the 8-byte hop's);
- an all-reduce of `--bytes` and an all-gather whose output is `--bytes`, as bus bandwidth (nccl-tests' busbw:
  2(N-1)/N and (N-1)/N of the bytes over the time).

    python benchmarks/gloo_link_cpu.py --output benchmarks/results/gloo-link-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn, reps: int) -> tuple[float, float]:
    """(fastest, median) seconds of `fn` over `reps` runs, every rank starting together."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _rank(rank: int, world: int, port: int, nbytes: int, reps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    def hop(send, recv):
        def run():
            works = [group.send([send], nxt, 0), group.recv([recv], prev, 0)]
            for w in works:
                w.wait()

        return run

    small = hop(torch.zeros(2, dtype=torch.float32), torch.empty(2, dtype=torch.float32))
    n = nbytes // 4
    large = hop(torch.ones(n), torch.empty(n))
    reduce_buf = torch.ones(n)
    gathered, part = torch.empty(n - n % world), torch.ones(n // world)
    timed = {
        "hop_8_bytes": _timed(small, reps),
        "hop": _timed(large, reps),
        "all_reduce": _timed(lambda: dist.all_reduce(reduce_buf, group=group), reps),
        "all_gather": _timed(lambda: dist.all_gather_into_tensor(gathered, part, group=group), reps),
    }
    row = {f"{k}_s": v[0] for k, v in timed.items()} | {f"{k}_median_s": v[1] for k, v in timed.items()}
    if rank == 0:
        out.put(row)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, nbytes: int, reps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, nbytes, reps, out)) for r in range(world)]
    for p in procs:
        p.start()
    row = out.get(timeout=600)
    for p in procs:
        p.join()
    frac = (world - 1) / world
    row.update(
        world_size=world,
        latency_s=row["hop_8_bytes_s"],
        hop_bytes_per_s=nbytes / max(row["hop_s"] - row["hop_8_bytes_s"], 1e-9),
        all_reduce_bus_bytes_per_s=2 * frac * nbytes / row["all_reduce_s"],
        all_gather_bus_bytes_per_s=frac * nbytes / row["all_gather_s"],
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--bytes", type=int, default=16 * 10**6)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--output")
    args = parser.parse_args()
    load = os.getloadavg()  # the machine is shared: what else ran shows here
    rows = [measure(int(w), args.bytes, args.reps) for w in args.world_sizes.split(",")]
    for r in rows:
        print(
            f"N={r['world_size']}: 8-byte hop {r['latency_s'] * 1e3:.3f} ms, "
            f"hop {r['hop_bytes_per_s'] / 1e9:.2f} GB/s, "
            f"all-reduce {r['all_reduce_bus_bytes_per_s'] / 1e9:.2f} GB/s, "
            f"all-gather {r['all_gather_bus_bytes_per_s'] / 1e9:.2f} GB/s (bus)"
        )
    if args.output:
        meta = dict(bytes=args.bytes, reps=args.reps, torch=torch.__version__, cpus=os.cpu_count())
        meta.update(date=time.strftime("%Y-%m-%d"), load_average_before=load)
        with open(args.output, "w") as f:
            json.dump(dict(settings=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
