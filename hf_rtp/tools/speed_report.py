"""`hf-rtp estimate --speed`: its options (every hardware constant of speed.py, overridable) and its report.

    hf-rtp estimate ./llama-3.1-8b --world-size 8 --batch 2 --seq 8192 --speed --recompute selective [--json]

Prints the constants used and where each came from, each strategy's step time and tokens/s per GPU with its compute,
exposed communication and host time, what holds RTP beyond its compute, and RTP at the ring's goal of 50 us host time
per hop. Imports nothing beyond what `import hf_rtp` has imported, as memory.py (cli.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from ..settings import DEFAULT_PIECE_SIZE, parse_size
from .speed import GOAL_HOST_HOP_S, HARDWARE, RECOMPUTE, Hardware, Run, Shape, binds, estimate

OPTIONS = {  # option: (field, scale from the option's unit, unit)
    "--flop-rate": ("flop_s", 1e12, "TFLOP/s"),
    "--link-bandwidth": ("link_bytes_s", 1e9, "GB/s"),
    "--collective-bandwidth": ("collective_bytes_s", 1e9, "GB/s"),
    "--latency-us": ("latency_s", 1e-6, "us"),
    "--host-hop-us": ("host_hop_s", 1e-6, "us"),
    "--host-collective-us": ("host_collective_s", 1e-6, "us"),
    "--time-slice-ms": ("slice_s", 1e-3, "ms"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`hf-rtp estimate --speed`'s options, added to `p` (cli.py's and memory_qlora.parser's)."""
    g = p.add_argument_group("speed", "with --speed: step time per GPU instead of memory (hf_rtp/tools/speed.py)")
    g.add_argument(
        "--speed",
        action="store_true",
        help="each strategy's step time and tokens/s per GPU, its compute, exposed communication and host time, on "
        "--hardware with every constant printed; bf16 autocast over float32 weights unless --dtype float32 is given",
    )
    g.add_argument("--json", action="store_true", help="with --speed: the report as JSON")
    g.add_argument(
        "--hardware", choices=sorted(HARDWARE), default="h100", help="whose constants (default h100: H100 SXM, NVLink)"
    )
    g.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help="activation recomputation: full (gradient checkpointing), selective (torchtitan's op policy) or none "
        "(default: full with --gradient-checkpointing, else none)",
    )
    for option, (name, _, unit) in OPTIONS.items():
        g.add_argument(option, type=float, metavar=unit, help=f"override the hardware's {name} (in {unit})")
    g.add_argument("--piece-size", default=DEFAULT_PIECE_SIZE, help="from_pretrained's rotation_piece_size (16MB)")


def hardware_from(args: argparse.Namespace) -> Hardware:
    hw = HARDWARE[args.hardware]
    given = {}
    for option, (name, scale, _) in OPTIONS.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None:
            if value < 0 or (value == 0 and name in ("flop_s", "link_bytes_s", "collective_bytes_s")):
                raise SystemExit(f"hf-rtp estimate: {option} must be positive, got {value}")
            given[name] = value * scale
    return replace(hw, **given) if given else hw


def _constants(hw: Hardware, base: Hardware, run: Run) -> list[str]:
    """Each constant, its option and where it came from ("given": the command line's)."""
    sources = {k: v for keys, v in hw.sources for k in keys.split(", ")}
    lines = []
    for option, (name, scale, unit) in OPTIONS.items():
        value = getattr(hw, name)
        if name == "slice_s" and not value:
            continue
        source = sources.get(name, "") if value == getattr(base, name) else "given"
        lines.append(f"  {option:<22} {value / scale:<8.4g} {unit:<8} {source}")
    piece = f"{run.piece_bytes / 1e6:<8.4g} {'MB':<8}"
    lines.append(f"  {'--piece-size':<22} {piece} from_pretrained's rotation_piece_size")
    return lines


def report(args: argparse.Namespace) -> dict[str, Any]:
    """`hf-rtp estimate --speed`: prints the report (or its JSON) and returns it."""
    from . import memory

    if args.rtp_size is not None or args.load_in_4bit:
        raise SystemExit(
            "hf-rtp estimate: --speed models one flat ring, full fine-tuning: drop --rtp-size, --load-in-4bit"
        )
    if args.world_size < 1 or args.batch < 1 or args.seq < 1:
        raise SystemExit("hf-rtp estimate: --world-size, --batch and --seq must be at least 1")
    config = memory.config_from(args)
    explicit_fp32 = args.dtype in ("float32", "float64") and not args.autocast
    recompute = args.recompute or ("full" if args.gradient_checkpointing else "none")
    run = Run(args.world_size, args.batch, args.seq, recompute, "fp32" if explicit_fp32 else "bf16",
              parse_size(args.piece_size, "--piece-size"))  # fmt: skip
    hw = hardware_from(args)
    try:
        shape = Shape.of(config)
        results = estimate(config, run, hw)
    except ValueError as err:
        raise SystemExit(f"hf-rtp estimate: {err}") from None
    fsdp, ring = results["fsdp2"], results["rtp"]
    out: dict[str, Any] = {
        "model": config.model_type,
        "parameters": shape.params,
        "run": asdict(run),
        "hardware": {k: v for k, v in asdict(hw).items() if k != "sources"} | {"sources": dict(hw.sources)},
        "strategies": {k: asdict(v) for k, v in results.items()},
        "rtp_over_fsdp2": ring.tokens_per_s / fsdp.tokens_per_s,
        "rtp_binds": binds(ring, hw),
    }
    if hw.host_hop_s > GOAL_HOST_HOP_S and not hw.slice_s:
        goal = estimate(config, run, replace(hw, host_hop_s=GOAL_HOST_HOP_S))["rtp"]
        out["rtp_at_goal_host_hop"] = {"host_hop_s": GOAL_HOST_HOP_S, **asdict(goal)}
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    precision = "bf16 autocast over float32 weights" if run.precision == "bf16" else "float32"
    print(
        f"{config.model_type}, {shape.params / 1e9:.2f}B parameters: batch {run.batch}x{run.seq} per rank "
        f"({run.tokens} tokens), {run.world} rank(s), {precision}, recomputation {run.recompute}"
    )
    print(f"hardware: {hw.name}" + (f", {hw.cores} cores shared by the ranks" if hw.cores else ""))
    print("\n".join(_constants(hw, HARDWARE[args.hardware], run)))
    print(
        f"{'strategy':<8} {'step s':>8} {'tokens/s/GPU':>13} {'compute s':>10} {'exposed comm s':>15} "
        f"{'host waited s':>14} {'host work s':>12} {'messages':>9} {'sent GB':>8}"
    )
    for r in results.values():
        print(
            f"{r.strategy:<8} {r.step_s:8.3f} {r.tokens_per_s:13.0f} {r.compute_s:10.3f} {r.comm_s:15.3f} "
            f"{r.host_s:14.3f} {r.host_total_s:12.3f} {r.messages:9d} {r.sent_gb:8.2f}"
        )
    print(f"RTP / FSDP2: {out['rtp_over_fsdp2']:.2f}x tokens/s. What holds RTP beyond compute: {out['rtp_binds']}")
    if "rtp_at_goal_host_hop" in out:
        goal = out["rtp_at_goal_host_hop"]
        print(
            f"RTP at {GOAL_HOST_HOP_S * 1e6:.0f} us host time per hop (the ring's goal): step {goal['step_s']:.3f} s, "
            f"{goal['tokens_per_s']:.0f} tokens/s per GPU, {goal['tokens_per_s'] / fsdp.tokens_per_s:.2f}x FSDP2"
        )
    return out
