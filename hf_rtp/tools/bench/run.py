"""`hf-rtp bench`'s runs: each strategy in fresh processes, forked from one rank server, measured from
outside; the table, results.json and bench.png. What it measures, and its options: options.py (the
command's help, which it parses without importing this module)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from .. import memory
from ..memory_qlora import estimate_qlora
from . import options
from .presets import make_preset
from .processes import device_args, peak_between, preloaded_ranks, run_ranks
from .worker import LORA_RANK, SHARED_BATCH, STRATEGIES, VARIANTS

SAME_TOKENS = "rtp-cp-same-tokens"
"""--long-sequence: context parallelism on one sequence of N x --seq tokens, the tokens RTP trains per step"""


def measure(strategy: str, checkpoint: str, world_size: int, args) -> dict:
    """Run one strategy on `world_size` ranks; summarise it as its worst rank."""
    label, seq = strategy, args.seq
    if strategy == SAME_TOKENS:
        strategy, seq = "rtp-cp", args.seq * world_size
    worker_args = [
        strategy,
        checkpoint,
        "--batch",
        str(args.batch),
        "--seq",
        str(seq),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--dtype",
        args.dtype,
        *device_args(args),
        "--threads",
        str(args.threads),
    ]
    if args.gradient_checkpointing:
        worker_args.append("--gradient-checkpointing")
    worker_args += ["--tiled-mlp", args.tiled_mlp]
    if args.autocast:
        worker_args.append("--autocast")
    if args.load_in_4bit:
        worker_args.append("--load-in-4bit")
    if strategy == "rtp-2d":
        worker_args += ["--rtp-size", str(args.rtp_size)]
    if strategy == "fsdp2":
        worker_args += ["--fsdp2-prefetch", str(args.fsdp2_prefetch)]
    if args.profile and label in args.profile_strategies.split(","):
        worker_args += ["--profile", args.profile]
    reports = run_ranks(
        "hf_rtp.tools.bench.worker", worker_args, world_size, threads=args.threads, timeout=args.timeout
    )
    for r in reports:
        samples = r.pop("rss_samples")
        if args.device.startswith("cuda"):
            r["peak"], r["load_peak"] = r["cuda_train_peak"], r["cuda_load_peak"]
        else:
            r["peak"] = peak_between(samples, r["load_end"], r["train_end"]) - r["baseline_rss"]
            r["load_peak"] = peak_between(samples, r["load_start"], r["load_end"]) - r["baseline_rss"]
    worst = max(reports, key=lambda r: r["peak"])
    step_s = max(r["step_s"] for r in reports)
    # Tensor parallelism and context parallelism train one batch on all ranks together; the others one per rank.
    batches = 1 if strategy in SHARED_BATCH else world_size
    # on a GPU, what torch's caching allocator held beside what it handed out (max_memory_reserved)
    reserved = {}
    if "cuda_train_reserved" in worst:
        reserved["reserved_gb"] = max(r["cuda_train_reserved"] for r in reports) / 1e9
    extra = {key: reports[0][key] for key in ("fsdp2",) if key in reports[0]}
    if any("profile" in r for r in reports):
        extra["profile"] = [path for r in reports for path in r.get("profile", [])]
    if any("profile_error" in r for r in reports):
        extra["profile_error"] = {r["rank"]: r["profile_error"] for r in reports if "profile_error" in r}
        print(f"  {label}'s profile failed (its figures stand): {next(iter(extra['profile_error'].values()))}")
    return {
        **reserved,
        **extra,
        "strategy": label,
        "world_size": world_size,
        "seq": seq,
        "peak_gb": worst["peak"] / 1e9,
        "load_peak_gb": max(r["load_peak"] for r in reports) / 1e9,
        "load_s": max(r["load_s"] for r in reports),
        "step_s": step_s,
        "tokens_per_s": batches * args.batch * seq / step_s,
        "local_param_gb": worst["local_param_bytes"] / 1e9,
        "ring_mb_per_step": max(r.get("ring_bytes_per_step", 0) for r in reports) / 1e6,
        "exchanges_per_step": max(r.get("exchanges_per_step", 0) for r in reports),
        "loss_first": reports[0]["losses"][0],  # rank 0's first batch is the same in every strategy
        "ranks": reports,
    }


def add_efficiency(rows: list[dict], states_gb: float) -> None:
    """Memory scaling efficiency (the RTP paper): ideal = model states / N + the activations of the
    local batch, taken from the single-process run as its peak minus the model states."""
    single = next((r for r in rows if r["strategy"] == "single"), None)
    if single is None:
        return
    activations = single["peak_gb"] - states_gb
    for r in rows:
        r["ideal_gb"] = states_gb / r["world_size"] + activations
        r["efficiency"] = r["ideal_gb"] / r["peak_gb"]


def shape(config, rows: list[dict], args) -> dict:
    """The model and the step every row measured: the config's sizes, the parameters a rank counted (a tied head
    once), the tokens per rank and the training's precision."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = ["num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads"]
    sizes += ["num_key_value_heads", "tie_word_embeddings"]
    return {
        "model_type": getattr(config, "model_type", None),
        **{key: getattr(text, key, None) for key in sizes},
        "parameters": next((r["ranks"][0]["parameters"] for r in rows if "parameters" in r["ranks"][0]), None),
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "tokens_per_rank": args.batch * args.seq,
        "weights": args.dtype,
        "autocast": "bfloat16" if args.autocast else None,
        "gradient_checkpointing": args.gradient_checkpointing,
        "optimizer": "AdamW",
    }


def measured_on(env: dict) -> str:
    """One line naming what the figures were measured on (a rank's `environment`, worker.py)."""
    line = f"measured on {env.get('device_name')} ({env.get('device')}), torch {env.get('torch')}"
    if env.get("cuda"):
        line += f", CUDA {env['cuda']}, NCCL {env.get('nccl_loaded') or 'not loaded'} (torch built with "
        line += f"{env.get('nccl_built')}), CUDA MPS client: {'yes' if env.get('cuda_mps_pipe_directory') else 'no'}"
    return line + f", backend {env.get('backend')}"


def table(rows: list[dict]) -> str:
    head = (
        f"{'strategy':<8} {'N':>2} {'peak GB/rank':>12} {'estimate':>8} {'efficiency':>10} {'step s':>7} "
        f"{'tokens/s':>9} {'load s':>7} {'load peak GB':>12}"
    )
    lines = [head, "-" * len(head)]

    def given(value, width: int, digits: int) -> str:  # "-" where a figure was not measured (efficiency: no single)
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

    for r in rows:
        lines.append(
            f"{r['strategy']:<8} {r['world_size']:>2} {r['peak_gb']:>12.3f} {given(r.get('estimate_gb'), 8, 3)} "
            f"{given(r.get('efficiency'), 10, 2)} {r['step_s']:>7.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['load_s']:>7.1f} "
            f"{r['load_peak_gb']:>12.3f}"
        )
    return "\n".join(lines)


def long_sequence_ratios(rows: list[dict]) -> list[str]:
    """--long-sequence: context parallelism against each strategy at one sequence of --seq tokens per context
    group (memory), and against RTP at the same tokens per step (time per token)."""
    out = []
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    for (strategy, n), cp in sorted(by.items()):
        if strategy != "rtp-cp":
            continue
        for other in ("rtp", "fsdp2", "ddp"):
            if (other, n) in by:
                out.append(f"N={n}: rtp-cp/{other}: peak per rank {cp['peak_gb'] / by[(other, n)]['peak_gb']:.2f}x")
        same, rtp = by.get((SAME_TOKENS, n)), by.get(("rtp", n))
        if same and rtp:
            out.append(
                f"N={n}: one sequence of {same['seq']} tokens across the ring / {n} sequences of {rtp['seq']} "
                f"(the same tokens per step): time per token {same['step_s'] / rtp['step_s']:.2f}x, peak "
                f"{same['peak_gb'] / rtp['peak_gb']:.2f}x"
            )
        out.append(
            f"N={n}: FSDP2 with torch's context_parallel: not run (not a strategy of the bench; on the CPU torch's "
            "ring attention handles CUDA SDPA kernels only)"
        )
    return out


def ratios(rows: list[dict]) -> list[str]:
    """RTP against each other strategy at the same world size: memory, step time, tokens/s."""
    out = []
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    for (strategy, n), rtp in sorted(by.items()):
        if strategy != "rtp":
            continue
        for other in ("ddp", "fsdp2", "tp"):
            if (other, n) in by:
                o = by[(other, n)]
                out.append(
                    f"N={n}: rtp/{other}: memory {rtp['peak_gb'] / o['peak_gb']:.2f}x, step time "
                    f"{rtp['step_s'] / o['step_s']:.2f}x, tokens/s {rtp['tokens_per_s'] / o['tokens_per_s']:.2f}x"
                )
        out.append(
            f"N={n}: rtp's ring per step per rank: {rtp.get('exchanges_per_step', 0):.0f} exchanges (hops), "
            f"{rtp.get('ring_mb_per_step', 0):.1f} MB sent"
        )
        grid = by.get(("rtp-2d", n))
        if grid:
            out.append(
                f"N={n}: rings of {grid.get('rtp_size')} ({n // grid.get('rtp_size', n)} replicas) / one flat ring: "
                f"memory {grid['peak_gb'] / rtp['peak_gb']:.2f}x, step time {grid['step_s'] / rtp['step_s']:.2f}x"
            )
        offload = by.get(("rtp-offload", n))
        if offload:
            saved = rtp["peak_gb"] - offload["peak_gb"]
            out.append(
                f"N={n}: offloaded/device optimizer (rtp-offload/rtp): step time "
                f"{offload['step_s'] / rtp['step_s']:.2f}x, memory {offload['peak_gb'] / rtp['peak_gb']:.2f}x "
                f"({abs(saved):.3f} GB {'less' if saved >= 0 else 'more'} per rank)"
            )
        zero, unfused = by.get(("rtp-zero-loss", n)), by.get(("rtp-unfused", n))
        if unfused:
            out.append(
                f"N={n}: fused/unfused RTP: memory {rtp['peak_gb'] / unfused['peak_gb']:.2f}x, "
                f"step time {rtp['step_s'] / unfused['step_s']:.2f}x"
            )
        if zero and unfused:
            fused_loss, plain_loss = rtp["peak_gb"] - zero["peak_gb"], unfused["peak_gb"] - zero["peak_gb"]
            out.append(
                f"N={n}: loss memory (peak minus the zero-loss run): fused {fused_loss:.3f} GB, unfused "
                f"{plain_loss:.3f} GB ({fused_loss / plain_loss:.1%})"
            )
    return out


def chart(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["world_size"] for r in rows if r["strategy"] != "single"}) or [1]
    strategies = [s for s in STRATEGIES + VARIANTS if any(r["strategy"] == s for r in rows)]
    panels = 3 if len(sizes) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    width = 0.8 / len(sizes)
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    for k, n in enumerate(sizes):
        picked = [by.get((s, 1 if s == "single" else n)) for s in strategies]  # the single run beside every N
        xs = [i + k * width for i in range(len(strategies))]
        axes[0].bar(xs, [r["peak_gb"] if r else 0 for r in picked], width, label=f"N={n}")
        axes[1].bar(xs, [r["tokens_per_s"] if r else 0 for r in picked], width, label=f"N={n}")
    for ax, label in zip(axes[:2], ("peak memory per rank (GB)", "global tokens/s"), strict=True):
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(strategies))], strategies)
        ax.set_ylabel(label)
        ax.legend()
    if panels == 3:
        for s in strategies:
            pts = sorted((r["world_size"], r["peak_gb"]) for r in rows if r["strategy"] == s)
            axes[2].plot(*zip(*pts, strict=True), marker="o", label=s)
        ideal = sorted((r["world_size"], r["ideal_gb"]) for r in rows if r["strategy"] == "rtp" and "ideal_gb" in r)
        if ideal:
            axes[2].plot(*zip(*ideal, strict=True), linestyle="--", color="gray", label="ideal")
        axes[2].set_xlabel("world size")
        axes[2].set_ylabel("peak memory per rank (GB)")
        axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _within_budget(args, checkpoint, config, runs) -> dict:
    from . import budget

    rows = budget.run(args, checkpoint, config, runs, measure)
    print("\n" + budget.table(rows, args.budget_gb, args.long_sequence))
    result = {"settings": vars(args), "checkpoint": checkpoint, "budget": rows}
    with open(os.path.join(args.output, "budget.json"), "w") as f:
        json.dump(result, f, indent=1)
    budget.chart(rows, args, os.path.join(args.output, "budget.png"))
    print(f"\nwrote {os.path.join(args.output, 'budget.json')} and {os.path.join(args.output, 'budget.png')}")
    return result


def parse_args(argv=None):
    return options.parser().parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        sizes = [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        sizes = [0]
    if args.hop_cost:
        from . import hops

        return hops.run(args, sizes)
    default = "ddp,fsdp2,rtp" if args.load_in_4bit else ",".join(STRATEGIES)
    if args.long_sequence:
        default, args.batch = "ddp,fsdp2,rtp,rtp-cp", 1
    strategies = (args.strategies or default).split(",")
    if args.grpo:
        default = "ddp,rtp"
        strategies = (args.strategies or default).split(",")
    known = STRATEGIES + VARIANTS + (("rtp-weights", "rtp-whole") if args.generate else ())
    unknown = set(strategies) - set(known)
    if unknown or any(n < 1 for n in sizes):
        raise SystemExit(f"strategies must be among {', '.join(known)} and world sizes >= 1")
    if "rtp-2d" in strategies and args.rtp_size is None:
        raise SystemExit("--strategies rtp-2d needs --rtp-size K: the ranks per ring")
    if args.rtp_size is not None:
        if args.rtp_size < 1 or not any(n % args.rtp_size == 0 and n > args.rtp_size for n in sizes):
            raise SystemExit(
                f"--rtp-size must be a proper divisor of a world size in --world-sizes, got {args.rtp_size}"
            )
        if "rtp-2d" not in strategies:
            strategies.append("rtp-2d")
    if args.fsdp2_prefetch < 0:
        raise SystemExit(f"--fsdp2-prefetch must be 0 (implicit) or a number of layers, got {args.fsdp2_prefetch}")
    if args.profile and not set(args.profile_strategies.split(",")) & set(strategies):
        raise SystemExit(
            f"--profile-strategies {args.profile_strategies} names none of the strategies run ({','.join(strategies)})"
        )
    if args.warmup < 1 or args.steps < 1:
        # AdamW allocates its moments in the first step: a peak taken before the second would miss them
        raise SystemExit("--warmup and --steps must each be at least 1: the first step allocates the optimizer state")
    if args.device.startswith("cuda"):
        import torch

        gpus, shared = torch.cuda.device_count(), args.device != "cuda"
        if shared and int(args.device.split(":")[1]) >= gpus:
            raise SystemExit(f"--device {args.device}: {gpus} GPU(s) visible")
        if not shared and max(sizes) > gpus and any(s != "single" for s in strategies):
            raise SystemExit(
                f"--device cuda needs one GPU per rank (NCCL); {gpus} visible. Use --strategies single, smaller "
                "--world-sizes, or --device cuda:0 to put every rank on one GPU (see --help)."
            )
    os.makedirs(args.output, exist_ok=True)
    # every strategy's ranks fork from one process that imported once; on a GPU each rank is a new interpreter:
    # bitsandbytes, which PEFT imports, starts CUDA at import, and a fork of a process that has started CUDA
    # cannot use it
    ranks = contextlib.nullcontext() if args.device.startswith("cuda") else preloaded_ranks(args.threads)
    with ranks:
        return _run(args, sizes, strategies)


def _run(args, sizes: list[int], strategies: list[str]) -> dict:
    checkpoint = args.checkpoint or make_preset(
        args.preset, os.path.join(tempfile.gettempdir(), f"hf-rtp-bench-{args.preset}")
    )
    name = os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint else args.preset
    if args.grpo:
        from . import grpo

        return grpo.run(args, checkpoint, sizes, strategies, name)
    if args.generate:
        from . import decode

        picked = [s for s in strategies if s in decode.STRATEGIES] if args.strategies else list(decode.STRATEGIES)
        return decode.run(args, checkpoint, sizes, picked, name)
    config = memory.load_config(checkpoint)
    states_gb = memory.model_states_bytes(config, args.dtype) / 1e9

    runs = [("single", 1)] if "single" in strategies else []
    runs += [
        (s, n)
        for n in sizes
        for s in strategies
        if s != "single" and (s != "rtp-2d" or (n % args.rtp_size == 0 and n > args.rtp_size))
    ]
    if args.budget_gb is not None:
        return _within_budget(args, checkpoint, config, [(s, n) for s, n in runs if s != "rtp-zero-loss"])
    if args.long_sequence and "rtp-cp" in strategies and "rtp" in strategies:
        runs += [(SAME_TOKENS, n) for n in sizes if n > 1]
    rows = []
    failed = []
    for strategy, n in runs:
        print(f"running {strategy} on {n} rank(s) ...", flush=True)
        try:
            row = measure(strategy, checkpoint, n, args)
        except RuntimeError as err:  # e.g. TP when the heads do not divide by N: report it, run the rest
            reason = str(err).strip().splitlines()[-1]
            print(f"  {strategy} on {n} rank(s) failed: {reason}", flush=True)
            failed.append({"strategy": strategy, "world_size": n, "error": str(err)[-4000:]})
            continue
        grid = strategy == "rtp-2d"
        if args.load_in_4bit:  # the worker's QLoRA: NF4 with double quantization, LoRA r=16 on every linear
            estimates = estimate_qlora(
                config,
                n,
                batch=args.batch,
                seq=args.seq,
                lora_rank=LORA_RANK,
                gradient_checkpointing=args.gradient_checkpointing,
                dtype=args.dtype,
                device=args.device,
            )
        else:
            estimates = memory.estimate(
                config,
                n,
                batch=args.batch,
                seq=args.seq,
                dtype=args.dtype,
                gradient_checkpointing=args.gradient_checkpointing,
                autocast=args.autocast,
                rtp_size=args.rtp_size if grid else None,
                device=args.device,
                tiled_mlp=memory.tiled_setting(args.tiled_mlp),
                optimizer_offload=strategy == "rtp-offload",
            )
            if strategy == SAME_TOKENS:
                estimates = memory.estimate(
                    config, n, batch=args.batch, seq=row["seq"], dtype=args.dtype,
                    gradient_checkpointing=args.gradient_checkpointing, autocast=args.autocast, device=args.device,
                    tiled_mlp=memory.tiled_setting(args.tiled_mlp),
                )  # fmt: skip
        key = "rtp-cp" if strategy == SAME_TOKENS else "rtp" if grid else strategy
        row["estimate_gb"] = estimates.get(key, float("nan")) / 1e9
        if args.device.startswith("cuda"):  # beside max_memory_allocated: the estimate less the CUDA context and NCCL
            row["estimate_process_gb"] = row["estimate_gb"]
            row["estimate_gb"] -= memory.outside_allocator(key, n, args.device, args.rtp_size if grid else None) / 1e9
        if grid:
            row["rtp_size"] = args.rtp_size
        rows.append(row)
    add_efficiency(rows, states_gb)

    title = f"{name}: batch {args.batch}x{args.seq} per rank, {args.dtype} AdamW, {args.device}"
    if args.autocast:
        title += ", bf16 autocast"
    if args.gradient_checkpointing:
        title += ", gradient checkpointing"
    if args.long_sequence:
        title = f"{name}: one sequence of {args.seq} tokens per context group, {args.dtype} AdamW, {args.device}"
    if args.load_in_4bit:
        title += ", QLoRA (NF4 base, LoRA r=16)"
    print(f"\n{title}\n{table(rows)}\n" + "\n".join(long_sequence_ratios(rows) if args.long_sequence else ratios(rows)))
    for r in rows:
        if "reserved_gb" in r:
            print(
                f"{r['strategy']} N={r['world_size']} on {args.device}: max_memory_allocated {r['peak_gb']:.3f} GB, "
                f"max_memory_reserved {r['reserved_gb']:.3f} GB per rank; estimated {r['estimate_gb']:.3f} GB "
                f"allocated, {r.get('estimate_process_gb', float('nan')):.3f} GB for the process"
            )
    for r in rows:
        if r["ring_mb_per_step"]:
            print(f"{r['strategy']} N={r['world_size']}: {r['ring_mb_per_step']:.2f} MB per rank on the ring per step")
    for f in failed:
        print(f"{f['strategy']} on {f['world_size']} rank(s) failed (see results.json)")
    environment = next((r["ranks"][0]["environment"] for r in rows if "environment" in r["ranks"][0]), None)
    if environment:
        print(measured_on(environment))
    result = {
        "settings": vars(args),
        "checkpoint": checkpoint,
        "environment": environment,
        "model": shape(config, rows, args),
        "model_states_gb": states_gb,
        "results": rows,
        "failed": failed,
    }
    with open(os.path.join(args.output, "results.json"), "w") as out:
        json.dump(result, out, indent=1)
    chart(rows, os.path.join(args.output, "bench.png"), title)
    print(f"\nwrote {os.path.join(args.output, 'results.json')} and {os.path.join(args.output, 'bench.png')}")
    return result
