"""`hf-rtp bench --generate 1,8,32`: greedy decoding speed and memory, side by side.

GRPO-style training spends most of its time in `generate`. A decode step carries few tokens, and each of
hf_rtp's rotated ops then moves the tokens rather than its weights (from_pretrained's rotation_moves). This
measures tokens/s of greedy `generate` (exactly --new-tokens new tokens) per batch size per rank, for the
whole model on every rank (what DDP decodes with), transformers' tensor parallelism (`tp_plan="auto"`, one
batch on all ranks together), hf_rtp, hf_rtp walking weights only (rtp-weights), and hf_rtp decoding on a
copy gathered by hf_rtp.whole_model (rtp-whole), with each one's peak
memory per rank during the decode (CPU: VmRSS above the
process's size before loading; GPU: torch.cuda.max_memory_allocated). Writes generate.json and
generate.png to --output.
"""

from __future__ import annotations

import json
import os

from .processes import device_args, peak_between, run_ranks

# rtp-weights: hf_rtp with rotation_moves="weights", every op walking its weights as in training (how hf_rtp
# decoded before ops could move the tokens); rtp-whole: hf_rtp's model, decoding on hf_rtp.whole_model's gathered
# copy (the rotated model stays held)
STRATEGIES = ("ddp", "tp", "rtp", "rtp-weights", "rtp-whole")


def measure(strategy: str, checkpoint: str, world_size: int, args) -> list[dict]:
    worker_args = [
        strategy,
        checkpoint,
        "--seq",
        str(args.seq),
        "--dtype",
        args.dtype,
        *device_args(args),
        "--threads",
        str(args.threads),
        "--generate",
        args.generate,
        "--new-tokens",
        str(args.new_tokens),
    ]
    if args.autocast:
        worker_args.append("--autocast")
    reports = run_ranks(
        "hf_rtp.tools.bench.worker", worker_args, world_size, threads=args.threads, timeout=args.timeout
    )
    rows = []
    for k, run in enumerate(reports[0]["decode"]):
        per_rank = [r["decode"][k] for r in reports]
        if args.device.startswith("cuda"):
            peak = max(p["cuda_peak"] for p in per_rank)
        else:
            peak = max(
                peak_between(r["rss_samples"], p["start"], p["end"]) - r["baseline_rss"]
                for r, p in zip(reports, per_rank, strict=True)
            )
        seconds = max(p["seconds"] for p in per_rank)
        sequences = run["batch"] * (1 if strategy == "tp" else world_size)  # TP decodes one batch on all ranks
        rows.append(
            {
                "strategy": strategy,
                "world_size": world_size,
                "batch": run["batch"],
                "seconds": seconds,
                "tokens_per_s": sequences * args.new_tokens / seconds,
                "peak_gb": peak / 1e9,
                "gather_s": max((p["gather_s"] or 0.0) for p in per_rank) if strategy == "rtp-whole" else None,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'strategy':<9} {'N':>2} {'batch/rank':>10} {'decode s':>9} {'new tokens/s':>12} {'peak GB/rank':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        gather = f"   (gathered in {r['gather_s']:.2f} s)" if r.get("gather_s") is not None else ""
        lines.append(
            f"{r['strategy']:<9} {r['world_size']:>2} {r['batch']:>10} {r['seconds']:>9.2f} "
            f"{r['tokens_per_s']:>12.1f} {r['peak_gb']:>12.3f}" + gather
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    by = {(r["strategy"], r["world_size"], r["batch"]): r for r in rows}
    out = []
    for (strategy, n, batch), rtp in sorted(by.items()):
        if strategy != "rtp":
            continue
        for other in ("ddp", "tp", "rtp-weights", "rtp-whole"):
            o = by.get((other, n, batch))
            if o:
                out.append(
                    f"N={n} batch {batch}: rtp/{other}: tokens/s {rtp['tokens_per_s'] / o['tokens_per_s']:.2f}x, "
                    f"memory {rtp['peak_gb'] / o['peak_gb']:.2f}x"
                )
    return out


def chart(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in STRATEGIES:
        for n in sorted({r["world_size"] for r in rows}):
            picked = sorted((r["batch"], r) for r in rows if r["strategy"] == strategy and r["world_size"] == n)
            if picked:
                batches = [b for b, _ in picked]
                axes[0].plot(batches, [r["tokens_per_s"] for _, r in picked], marker="o", label=f"{strategy} N={n}")
                axes[1].plot(batches, [r["peak_gb"] for _, r in picked], marker="o", label=f"{strategy} N={n}")
    for ax, label in zip(axes, ("new tokens/s (all ranks)", "peak memory per rank (GB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences per rank")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args, checkpoint: str, sizes: list[int], strategies: list[str], name: str) -> dict:
    rows, failed = [], []
    for n in sizes:
        for strategy in strategies:
            print(f"decoding with {strategy} on {n} rank(s), batches {args.generate} ...", flush=True)
            try:
                rows += measure(strategy, checkpoint, n, args)
            except RuntimeError as err:  # e.g. TP when the heads do not divide by N: report it, run the rest
                print(f"  {strategy} on {n} rank(s) failed: {str(err).strip().splitlines()[-1]}", flush=True)
                failed.append({"strategy": strategy, "world_size": n, "error": str(err)[-4000:]})
    title = (
        f"{name}: greedy decode of {args.new_tokens} tokens after {args.seq}, {args.dtype}"
        + (", bf16 autocast" if args.autocast else "")
        + f", {args.device}"
    )
    print(f"\n{title}\n{table(rows)}\n" + "\n".join(ratios(rows)))
    result = {"settings": vars(args), "checkpoint": checkpoint, "decode": rows, "failed": failed}
    with open(os.path.join(args.output, "generate.json"), "w") as f:
        json.dump(result, f, indent=1)
    chart(rows, os.path.join(args.output, "generate.png"), title)
    print(f"\nwrote {os.path.join(args.output, 'generate.json')} and {os.path.join(args.output, 'generate.png')}")
    return result
