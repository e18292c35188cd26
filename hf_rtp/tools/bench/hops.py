"""`hf-rtp bench --hop-cost`: the host time of one hop of the ring, beside a bare loop of the same exchanges.

A training step of a rotated model is a long series of hops, each a point-to-point exchange, a matmul and the
Python around them. At tiny shapes (a piece of 8 x 8 float32, a 4 x 8 input) the exchange and the matmul cost
little, so what a hop costs is mostly host time. Each rank times, in one run:

- walk: `Ring.forward_walk` with a tiny matmul per piece, and `Ring.backward_walk` with the two matmuls of a
  linear's backward (the weight's share into the travelling accumulator, the input's gradient);
- watched: the same walks on a watched ring (NCCL's: every hop one message with its header inside, the headers'
  digest checked once a walk, a watch thread over the hops in flight), over gloo, so that what the watch costs the
  host is measured on every machine;
- bare: a loop of the same exchanges (the group's own `send` / `recv` to the same neighbours, the same tensors, as
  the ring posts them on gloo) and the same matmuls, with nothing else.

The cases take turns walk by walk, so all see the same machine, in rounds whose order is reversed every other
round; each order's median round, the two averaged, is reported as microseconds per hop (a forward walk makes N-1
hops; a backward walk N-1 hops of weights and N-1 of gradient accumulators, counted as exchanges) and as walk / bare
within each rank (the worst rank's), twice: in wall time (the peer's time and gloo's included) and in the calling
thread's CPU time (`time.thread_time`: the host's own work per hop, the waits left out). What the ring adds per hop
is the difference: the pool, its Pending objects, the closures, the walk's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

ROWS, COLS, TOKENS = 8, 8, 4  # a piece of 8 x 8 float32 (256 bytes), a 4 x 8 input


def _pair(send, recv, nxt: int, prv: int, group, tag: int) -> list:
    """A bare hop's send to the next rank and receive from the previous one (their ranks in `group`), as the ring
    posts them on gloo: on the group itself, without dist.isend's checks, which the ring makes once."""
    return [group.send([send], nxt, tag), group.recv([recv], prv, tag)]


def _bare_forward(group, own, buffers, x, out, world, rank):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    held, index = own, rank
    for step in range(world):
        last = step == world - 1
        if not last:
            incoming = buffers[step % 2]
            works = _pair(held, incoming, nxt, prv, group, 0)
        out[:, index * ROWS : (index + 1) * ROWS] = x @ held.T
        if not last:
            for w in works:
                w.wait()
            held, index = incoming, (index - 1) % world


def _bare_backward(group, own, buffers, grads, home, x, grad_out, grad_in, world, rank):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    held, index, acc = own, rank, grads[1]
    for step in range(world):
        last = step == world - 1
        following = (index - 1) % world
        works = []
        if not last:
            incoming = buffers[step % 2]
            works += _pair(held, incoming, nxt, prv, group, 0)
        share = grad_out[:, index * ROWS : (index + 1) * ROWS].T @ x
        if step == 0:
            home.copy_(share)
        else:
            if step == 1:
                acc = grads[1]
                acc.zero_()
            acc.add_(share)
            landing = grads[(step + 1) % 2]
            works += _pair(acc, landing, nxt, prv, group, 64)
        grad_in.addmm_(grad_out[:, index * ROWS : (index + 1) * ROWS], held)
        for w in works:
            w.wait()
        if not last:
            held = incoming
        if step > 0:
            acc = landing
            if last:
                home.add_(landing)
        index = following


def main(argv=None) -> None:
    """One rank: the timings as one JSON line."""
    from ...distributed.tensors.sharding import ChunkLayout
    from ...distributed.transport.ring import Ring

    p = argparse.ArgumentParser()
    p.add_argument("--walks", type=int, default=200, help="walks per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds, each order in turn: at least 2")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be 2 or more: every other round runs the cases in reverse, and each order is summarised")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # hf_rtp's rings talk on groups of their own
    ring = Ring(group)
    watched = Ring(dist.new_group(list(range(world))), watched=True, timeout_s=600.0)  # a group of its own, as NCCL's
    layout = ChunkLayout((torch.Size((world * ROWS, COLS)),), world)
    gen = torch.Generator().manual_seed(rank)
    own = torch.randn(ROWS, COLS, generator=gen)
    x = torch.randn(TOKENS, COLS, generator=gen)
    grad_out = torch.randn(TOKENS, world * ROWS, generator=gen)
    out, grad_in = torch.zeros(TOKENS, world * ROWS), torch.zeros(TOKENS, COLS)
    buffers = [torch.empty(ROWS, COLS) for _ in range(2)]
    grads = [torch.empty(ROWS, COLS) for _ in range(2)]
    home = torch.empty(ROWS, COLS)
    ring.plan(layout, own)
    watched.plan(layout, own)

    def compute(rows, held):
        out[:, rows[0] : rows[1]] = x @ held[0].T

    def accumulate(rows, held, acc):
        acc[0].add_(grad_out[:, rows[0] : rows[1]].T @ x)

    def input_grad(rows, held):
        grad_in.addmm_(grad_out[:, rows[0] : rows[1]], held[0])

    cases = {
        "walk forward": lambda: ring.forward_walk([own], layout, compute),
        "watched forward": lambda: watched.forward_walk([own], layout, compute),
        "bare forward": lambda: _bare_forward(group, own, buffers, x, out, world, rank),
        "walk backward": lambda: ring.backward_walk([own], layout, accumulate, input_grad),
        "watched backward": lambda: watched.backward_walk([own], layout, accumulate, input_grad),
        "bare backward": lambda: _bare_backward(group, own, buffers, grads, home, x, grad_out, grad_in, world, rank),
    }
    for case in cases.values():  # warm: the pool's slots, gloo's pairs
        for _ in range(5):
            case()
    wall: dict[str, list[float]] = {name: [] for name in cases}
    host: dict[str, list[float]] = {name: [] for name in cases}
    for turn in range(args.rounds):
        # The cases take turns walk by walk, so each sees the machine the others see (on two shared cores, gloo's
        # threads and the other ranks make a run of one case alone faster or slower by 1.5x from one second to the
        # next); every other round in reverse, so no case always follows the same one. A rank's wait for its peer to
        # finish the case before is charged to the next case, so each order's rounds are summarised apart, and the
        # two orders averaged (per_hop).
        order = list(cases.items())[:: 1 if turn % 2 == 0 else -1]
        spent = {name: [0.0, 0.0] for name in cases}
        dist.barrier(group)
        for _ in range(args.walks):
            for name, case in order:
                start, cpu = time.perf_counter(), time.thread_time()
                case()
                spent[name][0] += time.perf_counter() - start
                spent[name][1] += time.thread_time() - cpu  # this thread's own time: the host's work, no waiting
        for name, (seconds, cpu_seconds) in spent.items():
            wall[name].append(seconds)
            host[name].append(cpu_seconds)
    hops = {"forward": world - 1, "backward": 2 * (world - 1)}

    def per_hop(rounds: dict[str, list[float]]) -> dict[str, float]:
        """Microseconds per hop: the median round of each order, the two orders' mean."""
        return {
            name: statistics.mean(statistics.median(s[o::2]) for o in (0, 1))
            / (args.walks * hops[name.split()[1]])
            * 1e6
            for name, s in rounds.items()
        }

    exchanges_before, messages_before = watched.exchanges, watched.messages
    watched.forward_walk([own], layout, compute)
    watched.backward_walk([own], layout, accumulate, input_grad)
    assert watched._watch is not None
    watched._watch.check()  # the headers matched all along
    print(json.dumps({"rank": rank, "world_size": world, "us_per_hop": per_hop(wall), "cpu_us_per_hop": per_hop(host),
                      "exchanges_per_walk": watched.exchanges - exchanges_before,
                      "watched_messages_per_hop": (watched.messages - messages_before)
                      / (watched.exchanges - exchanges_before)}))  # fmt: skip
    dist.destroy_process_group()


def run(args, sizes: list[int]) -> dict:
    """The driver: every world size, a table of microseconds per hop and the ratios, results.json in --output."""
    from .processes import run_ranks

    if args.device != "cpu" or args.backend:
        raise SystemExit("--hop-cost times the ring over gloo on the CPU: leave out --device and --backend")
    rows = []
    for n in sizes:
        if n < 2:
            continue
        print(f"hop cost on {n} ranks ...", flush=True)
        reports = run_ranks(__name__, ["--walks", str(args.steps), "--rounds", "6"], n, timeout=args.timeout)
        reports = [{k: v for k, v in r.items() if k != "rss_samples"} for r in reports]  # memory is not this mode's
        row: dict = {
            "world_size": n,
            "exchanges_per_walk": reports[0]["exchanges_per_walk"],
            "watched_messages_per_hop": max(r["watched_messages_per_hop"] for r in reports),
            "ranks": reports,
        }
        for key in ("us_per_hop", "cpu_us_per_hop"):
            row[key] = {k: max(r[key][k] for r in reports) for k in reports[0][key]}  # the slowest rank's
            # walk / bare within each rank (one rank's walk is never divided by another's bare), the worst rank's
            row[key.replace("us_per_hop", "ratio")] = {
                f"{case} {way}": max(r[key][f"{case} {way}"] / r[key][f"bare {way}"] for r in reports)
                for case in ("walk", "watched")
                for way in ("forward", "backward")
            }
        rows.append(row)
    for key, title in (("us_per_hop", "wall time"), ("cpu_us_per_hop", "the host thread's CPU time")):
        ratio = key.replace("us_per_hop", "ratio")
        print(f"\n{title} per hop (us), the slowest rank's; each / bare, the worst rank's; tiny pieces over gloo")
        print(f"{'N':>2} {'way':>8} {'bare':>8} {'walk':>8} {'ratio':>6} {'watched':>8} {'ratio':>6}")
        for row in rows:
            t, q = row[key], row[ratio]
            for way in ("forward", "backward"):
                print(
                    f"{row['world_size']:>2} {way:>8} {t[f'bare {way}']:8.1f} {t[f'walk {way}']:8.1f} "
                    f"{q[f'walk {way}']:6.2f} {t[f'watched {way}']:8.1f} {q[f'watched {way}']:6.2f}"
                )
    for row in rows:
        messages = row["watched_messages_per_hop"]
        print(f"{row['world_size']} ranks: a watched hop posts {messages:.0f} messages (a send and a receive)")
    result = {"mode": "hop-cost", "walks_per_round": args.steps, "rows": rows}
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
