"""`hf-rtp bench --budget-gb X`: each strategy's largest batch that fits X GB per rank, and its speed.

What a user picks a strategy by: how many tokens per second each one trains at the memory they have.
The estimate proposes the largest batch per rank it expects to fit; the bench then measures that
batch and steps down one sequence at a time until the measured peak is within the budget, so every
reported batch was seen to fit. A strategy that does not fit even one sequence is reported as such.
On a GPU the budget bounds what the bench measures there, what torch's allocator hands out
(max_memory_allocated); the CUDA context and NCCL's buffers come on top (`hf-rtp estimate` counts them).
"""

from __future__ import annotations

import argparse
import math

from .. import memory

MAX_BATCH = 64
SEQ_STEP = 256  # --long-sequence: lengths searched in steps of this many tokens
MAX_SEQ = 1 << 17


def _measured_part(estimate: float, strategy: str, world_size: int, args, rtp_size: int | None = None) -> float:
    """What of an estimate the bench measures: all of it on a CPU (VmRSS); on a GPU what torch's allocator hands
    out (max_memory_allocated), without the CUDA context and NCCL's buffers beside it."""
    return estimate - memory.outside_allocator(strategy, world_size, args.device, rtp_size)


def largest_batch(config, strategy: str, world_size: int, args) -> int:
    """The largest batch per rank whose estimate fits the budget (0 when none does)."""
    fits = 0
    for batch in range(1, MAX_BATCH + 1):
        grid = strategy == "rtp-2d"  # estimated as RTP on rings of --rtp-size
        rtp_size = args.rtp_size if grid else None
        key = "rtp" if grid else strategy
        estimate = memory.estimate(
            config,
            world_size,
            batch=batch,
            seq=args.seq,
            dtype=args.dtype,
            gradient_checkpointing=args.gradient_checkpointing,
            autocast=args.autocast,
            rtp_size=rtp_size,
            device=args.device,
            tiled_mlp=memory.tiled_setting(args.tiled_mlp),
        )[key]
        if _measured_part(estimate, key, world_size, args, rtp_size) / 1e9 > args.budget_gb:
            break
        fits = batch
    return fits


def longest_sequence(config, strategy: str, world_size: int, args) -> int:
    """--long-sequence: the longest sequence (a multiple of SEQ_STEP) whose estimate fits the budget (0: none)."""
    fits, seq = 0, SEQ_STEP
    while seq <= MAX_SEQ:
        estimate = memory.estimate(
            config, world_size, batch=1, seq=seq, dtype=args.dtype,
            gradient_checkpointing=args.gradient_checkpointing, autocast=args.autocast, device=args.device,
            tiled_mlp=memory.tiled_setting(args.tiled_mlp),
        )[strategy]  # fmt: skip
        if _measured_part(estimate, strategy, world_size, args) / 1e9 > args.budget_gb:
            break
        fits, seq = seq, seq + SEQ_STEP
    return fits


def run(args, checkpoint: str, config, runs: list[tuple[str, int]], measure) -> list[dict]:
    """Each strategy's largest batch of --seq tokens (with --long-sequence: its longest single sequence) that
    was measured within the budget."""
    rows = []
    key = "seq" if args.long_sequence else "batch"
    for strategy, n in runs:
        size = (longest_sequence if args.long_sequence else largest_batch)(config, strategy, n, args)
        row = None
        while size >= 1:
            shape = f"1 x {size}" if args.long_sequence else f"batch {size} x {args.seq}"
            print(f"running {strategy} on {n} rank(s) at {shape} ...", flush=True)
            try:
                measured = measure(strategy, checkpoint, n, argparse.Namespace(**{**vars(args), key: size}))
            except RuntimeError as err:  # e.g. TP when the heads do not divide by N: report it, run the rest
                print(f"  {strategy} on {n} rank(s) failed: {str(err).strip().splitlines()[-1]}", flush=True)
                break
            if measured["peak_gb"] <= args.budget_gb:
                row = dict(
                    measured,
                    batch=args.batch if args.long_sequence else size,
                    seq=size if args.long_sequence else args.seq,
                )
                break
            print(f"  peak {measured['peak_gb']:.2f} GB is over {args.budget_gb} GB: smaller", flush=True)
            size = size - SEQ_STEP * max(1, size // SEQ_STEP // 10) if args.long_sequence else size - 1
        rows.append(
            row
            or {"strategy": strategy, "world_size": n, "batch": 0, "seq": 0, "peak_gb": math.nan, "tokens_per_s": 0.0}
        )
    return rows


def sequence_ratios(rows: list[dict]) -> list[str]:
    """--long-sequence: how much longer a sequence context parallelism fits than each other strategy."""
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    out = []
    for (strategy, n), cp in sorted(by.items()):
        if strategy == "rtp-cp" and cp["seq"]:
            out += [
                f"N={n}: longest sequence, rtp-cp/{other}: {cp['seq'] / by[(other, n)]['seq']:.2f}x"
                for other in ("rtp", "fsdp2", "ddp")
                if by.get((other, n), {}).get("seq")
            ]
    return out


def table(rows: list[dict], budget_gb: float, long_sequence: bool = False) -> str:
    what = "longest seq" if long_sequence else "largest batch"
    head = f"{'strategy':<14} {'N':>2} {what:>13} {'peak GB/rank':>12} {'tokens/s':>9}"
    lines = [f"within {budget_gb} GB per rank", head, "-" * len(head)]
    for r in rows:
        fits = r["batch"] > 0
        size = r["seq"] if long_sequence else r["batch"]
        lines.append(
            f"{r['strategy']:<14} {r['world_size']:>2} {size if fits else 'none fits':>13} "
            f"{r['peak_gb'] if fits else math.nan:>12.3f} {r['tokens_per_s']:>9.0f}"
        )
    return "\n".join(lines + (sequence_ratios(rows) if long_sequence else []))


def chart(rows: list[dict], args, path: str) -> None:
    """Tokens/s each strategy trains at within the budget, its largest batch written on its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['strategy']}\nN={r['world_size']}" for r in rows]
    bars = ax.bar(labels, [r["tokens_per_s"] for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        size = f"seq {r['seq']}" if args.long_sequence else f"batch {r['batch']}"
        note = size if r["batch"] else "none fits"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("global tokens/s")
    ax.set_title(
        ("longest sequence" if args.long_sequence else f"largest batch x {args.seq} tokens")
        + f" within {args.budget_gb} GB per rank, {args.dtype}"
        + (", bf16 autocast" if args.autocast else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
