"""`hf-rtp bench --budget-gb X`: each strategy's largest batch that fits X GB per rank, and its speed.

What a user picks a strategy by: how many tokens per second each one trains at the memory they have.
The estimate proposes the largest batch per rank it expects to fit; the bench then measures that
batch and steps down one sequence at a time until the measured peak is within the budget, so every
reported batch was seen to fit. A strategy that does not fit even one sequence is reported as such.
"""

from __future__ import annotations

import argparse
import math

from .. import memory

MAX_BATCH = 64


def largest_batch(config, strategy: str, world_size: int, args) -> int:
    """The largest batch per rank whose estimate fits the budget (0 when none does)."""
    fits = 0
    for batch in range(1, MAX_BATCH + 1):
        grid = strategy == "rtp-2d"  # estimated as RTP on rings of --rtp-size
        estimate = memory.estimate(
            config,
            world_size,
            batch=batch,
            seq=args.seq,
            dtype=args.dtype,
            gradient_checkpointing=args.gradient_checkpointing,
            autocast=args.autocast,
            rtp_size=args.rtp_size if grid else None,
        )["rtp" if grid else strategy]
        if estimate / 1e9 > args.budget_gb:
            break
        fits = batch
    return fits


def run(args, checkpoint: str, config, runs: list[tuple[str, int]], measure) -> list[dict]:
    rows = []
    for strategy, n in runs:
        batch, row = largest_batch(config, strategy, n, args), None
        while batch >= 1:
            print(f"running {strategy} on {n} rank(s) at batch {batch} x {args.seq} ...", flush=True)
            try:
                measured = measure(strategy, checkpoint, n, argparse.Namespace(**{**vars(args), "batch": batch}))
            except RuntimeError as err:  # e.g. TP when the heads do not divide by N: report it, run the rest
                print(f"  {strategy} on {n} rank(s) failed: {str(err).strip().splitlines()[-1]}", flush=True)
                break
            if measured["peak_gb"] <= args.budget_gb:
                row = dict(measured, batch=batch)
                break
            print(f"  peak {measured['peak_gb']:.2f} GB is over {args.budget_gb} GB: one sequence less", flush=True)
            batch -= 1
        rows.append(
            row or {"strategy": strategy, "world_size": n, "batch": 0, "peak_gb": math.nan, "tokens_per_s": 0.0}
        )
    return rows


def table(rows: list[dict], budget_gb: float) -> str:
    head = f"{'strategy':<14} {'N':>2} {'largest batch':>13} {'peak GB/rank':>12} {'tokens/s':>9}"
    lines = [f"within {budget_gb} GB per rank", head, "-" * len(head)]
    for r in rows:
        fits = r["batch"] > 0
        lines.append(
            f"{r['strategy']:<14} {r['world_size']:>2} {r['batch'] if fits else 'none fits':>13} "
            f"{r['peak_gb'] if fits else math.nan:>12.3f} {r['tokens_per_s']:>9.0f}"
        )
    return "\n".join(lines)


def chart(rows: list[dict], args, path: str) -> None:
    """Tokens/s each strategy trains at within the budget, its largest batch written on its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['strategy']}\nN={r['world_size']}" for r in rows]
    bars = ax.bar(labels, [r["tokens_per_s"] for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        note = f"batch {r['batch']}" if r["batch"] else "none fits"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("global tokens/s")
    ax.set_title(
        f"largest batch x {args.seq} tokens within {args.budget_gb} GB per rank, {args.dtype}"
        + (", bf16 autocast" if args.autocast else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
