"""What `.ci/gpu-speed` reports (issue 66, points 1 and 3; issue 68, point 4): RTP beside FSDP2 and DDP at a shape
users train, RTP with its optimizer offloaded beside RTP, and the host time of a watched hop, in one JSON file and a
few printed lines.

    python benchmarks/gpu_speed.py slug "NVIDIA H200"   # h200: the device's name as .ci/gpu-speed names its files
    python benchmarks/gpu_speed.py summary --bench BENCH.json [--hops HOPS.json] --mps on|off --mps-why TEXT \\
        --output SUMMARY.json

`summary` reads `hf-rtp bench`'s results.json and benchmarks/hop_latency_cuda.py's JSON, and writes one file with
what the figures were measured on (device, torch, CUDA, NCCL built and loaded, CUDA MPS on or off and why), the
shape, every strategy's tokens/s and max_memory_allocated per rank, the ratios RTP/FSDP2 and RTP/DDP, rtp-offload
against rtp (hf_rtp.CPUOffloadOptimizer against torch's AdamW on the device: the step time's ratio, the memory per
rank saved), and the goals: RTP at least 0.9x FSDP2's tokens/s at most 0.9x its peak, rtp-offload's step at most
1.3x rtp's, a watched hop at most 50 us of host time. A goal not met
is a finding, not a failure: the exit code is 0 whenever the inputs were read. Imports nothing beyond the standard
library, so that the script can name its files before torch loads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

TOKENS_GOAL = 0.9
"""RTP's tokens/s at least this times FSDP2's at the same shape"""
PEAK_GOAL = 0.9
"""RTP's peak allocated memory per rank at most this times FSDP2's"""
OFFLOAD_STEP_GOAL = 1.3
"""issue 68, point 4: RTP's step time with hf_rtp.CPUOffloadOptimizer at most this times with torch's AdamW"""
HOP_HOST_GOAL_US = 50.0
"""issue 66, point 1: the host time of one watched hop on CUDA"""


def device_slug(name: str) -> str:
    """A device's name as a file name's part: lower case, the vendor's name dropped, runs of anything but letters
    and digits as one '-' ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"); "device" where
    nothing is left."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    if words[:1] == ["nvidia"]:
        words = words[1:]
    return "-".join(words) or "device"


def _rows(bench: dict) -> dict[str, dict]:
    """The bench's rows by strategy, at its one world size (.ci/gpu-speed runs one)."""
    return {r["strategy"]: r for r in bench.get("results", [])}


def rank_peaks_gb(row: dict) -> list[float]:
    """Each rank's peak in GB, as the bench measured it (on CUDA torch.cuda.max_memory_allocated), rank by rank."""
    return [r["peak"] / 1e9 for r in sorted(row["ranks"], key=lambda r: r["rank"])]


def ratios(bench: dict) -> dict[str, dict[str, float]]:
    """RTP against each of FSDP2 and DDP that ran: tokens/s and peak per rank (the worst rank's of each)."""
    rows = _rows(bench)
    rtp = rows.get("rtp")
    if rtp is None:
        return {}
    return {
        other: {
            "tokens_per_s": rtp["tokens_per_s"] / rows[other]["tokens_per_s"],
            "peak": rtp["peak_gb"] / rows[other]["peak_gb"],
        }
        for other in ("fsdp2", "ddp")
        if other in rows
    }


def offload(bench: dict) -> dict:
    """rtp-offload (hf_rtp.CPUOffloadOptimizer around AdamW) against rtp (torch's AdamW on the device), the same
    tokens a step: the step time's ratio (rtp's tokens/s over rtp-offload's), the memory per rank it saves (rtp's
    peak less rtp-offload's, the worst ranks', GB) and the peaks' ratio, and the torch threads a rank ran the host
    step on (the bench's --threads); where either did not run, None for each and `not_run` naming it."""
    rows = _rows(bench)
    rtp, off = rows.get("rtp"), rows.get("rtp-offload")
    threads = bench.get("settings", {}).get("threads")
    if rtp is None or off is None:
        missing = [name for name, row in (("rtp", rtp), ("rtp-offload", off)) if row is None]
        return {"step_time": None, "saved_gb": None, "peak": None, "host_threads": threads, "not_run": missing}
    return {
        "step_time": rtp["tokens_per_s"] / off["tokens_per_s"],
        "saved_gb": rtp["peak_gb"] - off["peak_gb"],
        "peak": off["peak_gb"] / rtp["peak_gb"],
        "host_threads": threads,
        "not_run": [],
    }


def goals(found: dict[str, dict[str, float]], offloaded: dict | None = None) -> dict[str, dict]:
    """Issue 66's goals for RTP against FSDP2 and issue 68's for rtp-offload against rtp, each with its ratio and
    whether it was met (None: a strategy it compares did not run)."""
    step = None if offloaded is None else offloaded["step_time"]
    fsdp2 = found.get("fsdp2")
    tokens = None if fsdp2 is None else fsdp2["tokens_per_s"]
    peak = None if fsdp2 is None else fsdp2["peak"]
    return {
        "tokens_per_s": {
            "goal": f">= {TOKENS_GOAL}x FSDP2's",
            "ratio": tokens,
            "met": None if tokens is None else tokens >= TOKENS_GOAL,
        },
        "peak": {"goal": f"<= {PEAK_GOAL}x FSDP2's", "ratio": peak, "met": None if peak is None else peak <= PEAK_GOAL},
        "offload_step_time": {
            "goal": f"<= {OFFLOAD_STEP_GOAL}x rtp's (AdamW on the device)",
            "ratio": step,
            "met": None if step is None else step <= OFFLOAD_STEP_GOAL,
        },
    }


def hop_host_us(hops: dict) -> dict[str, dict]:
    """From hop_latency_cuda.py's JSON: per message size, the host time of one hop of the ring as it runs (watched)
    and unwatched, in microseconds (the slower rank's median), and whether the watched one is within the goal."""
    out = {}
    for size, cases in hops.get("ms_per_message", {}).items():
        watched = cases["ring"]["host_ms"] * 1e3
        out[str(size)] = {
            "watched_us": watched,
            "unwatched_us": cases["ring-unwatched"]["host_ms"] * 1e3,
            "wall_watched_us": cases["ring"]["wall_ms"] * 1e3,
            "met": watched <= HOP_HOST_GOAL_US,
        }
    return out


def summarize(bench: dict, hops: dict | None, mps: bool, mps_why: str) -> dict:
    found, offloaded = ratios(bench), offload(bench)
    settings = bench.get("settings", {})
    return {
        "environment": bench.get("environment"),
        "mps": {"on": mps, "why": mps_why},
        "shape": {
            **(bench.get("model") or {}),
            "preset": settings.get("preset") if not settings.get("checkpoint") else None,
            "checkpoint": settings.get("checkpoint"),
            "world_size": settings.get("world_sizes"),
            "device": settings.get("device"),
            "backend": settings.get("backend"),
            "warmup": settings.get("warmup"),
            "steps": settings.get("steps"),
        },
        "strategies": {
            name: {
                "tokens_per_s": r["tokens_per_s"],
                "step_s": r["step_s"],
                "peak_gb_per_rank": rank_peaks_gb(r),
                "reserved_gb": r.get("reserved_gb"),
                **({"fsdp2": r["fsdp2"]} if "fsdp2" in r else {}),
            }
            for name, r in _rows(bench).items()
        },
        "failed": [f["strategy"] for f in bench.get("failed", [])],
        "ratios": found,
        "offload": offloaded,
        "goals": goals(found, offloaded),
        "hop_host_us": hop_host_us(hops) if hops else None,
        "profile": next((r["profile"] for r in bench.get("results", []) if r.get("profile")), None),
        "profile_error": next((r["profile_error"] for r in bench.get("results", []) if r.get("profile_error")), None),
    }


_NAMES = {
    "tokens_per_s": "tokens/s",
    "peak": "peak per rank",
    "offload_step_time": "step time with CPUOffloadOptimizer",
}


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "NOT met"


def lines(summary: dict) -> list[str]:
    """The printed summary."""
    env, shape = summary.get("environment") or {}, summary["shape"]
    params = shape.get("parameters")
    size = "?" if params is None else f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    cuda = f", CUDA {env.get('cuda')}, NCCL {env.get('nccl_loaded')} (torch built with {env.get('nccl_built')})"
    out = [
        f"on {env.get('device_name', '?')}: torch {env.get('torch', '?')}{cuda if env.get('cuda') else ''}; CUDA MPS "
        f"{'on' if summary['mps']['on'] else 'off (time-sliced)'}: {summary['mps']['why']}",
        f"{shape.get('preset') or shape.get('checkpoint')}: {size} parameters, {shape.get('num_hidden_layers')} layers "
        f"{shape.get('hidden_size')} wide, vocabulary {shape.get('vocab_size')}; {shape.get('world_size')} ranks on "
        f"{shape.get('device')}, {shape.get('batch_per_rank')} x {shape.get('seq')} tokens per rank, "
        f"{shape.get('autocast') or 'no'} autocast over {shape.get('weights')} weights, AdamW, gradient checkpointing "
        f"{'on' if shape.get('gradient_checkpointing') else 'off'}",
    ]
    for name, s in summary["strategies"].items():
        peaks = ", ".join(f"{p:.3f}" for p in s["peak_gb_per_rank"])
        out.append(f"  {name:<6} {s['tokens_per_s']:>10.0f} tokens/s  peak GB per rank (rank 0, 1, ...) {peaks}")
    for name in summary["failed"]:
        out.append(f"  {name:<6} FAILED (see the bench's results.json)")
    for other, r in summary["ratios"].items():
        out.append(f"rtp/{other}: tokens/s {r['tokens_per_s']:.2f}x, peak per rank {r['peak']:.2f}x")
    o = summary.get("offload")
    if o and o["not_run"]:
        out.append(f"rtp-offload/rtp: not measured ({' and '.join(o['not_run'])} did not run)")
    elif o:
        saved = f"{o['saved_gb']:.3f} GB saved" if o["saved_gb"] >= 0 else f"{-o['saved_gb']:.3f} GB more"
        out.append(
            f"rtp-offload/rtp: step time {o['step_time']:.2f}x, peak per rank {o['peak']:.2f}x ({saved} per rank); "
            f"the host step on {o['host_threads']} torch thread(s) per rank"
        )
    for key, g in summary["goals"].items():
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        out.append(f"goal: rtp's {_NAMES[key]} {g['goal']}: {ratio}, {_verdict(g['met'])}")
    if summary.get("profile_error"):
        out.append(f"the profile failed (the figures above stand): {summary['profile_error']}")
    if summary["hop_host_us"]:
        hops = ", ".join(
            f"{int(size) >> 10} KiB {h['watched_us']:.0f} us ({_verdict(h['met'])})"
            for size, h in summary["hop_host_us"].items()
        )
        out.append(f"host time per watched hop (goal <= {HOP_HOST_GOAL_US:.0f} us): {hops}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    slug = sub.add_parser("slug", help="a device's name as a file name's part")
    slug.add_argument("name")
    s = sub.add_parser("summary", help="the summary JSON and lines")
    s.add_argument("--bench", required=True, help="hf-rtp bench's results.json")
    s.add_argument("--hops", help="hop_latency_cuda.py's JSON (left out where it did not run)")
    s.add_argument("--mps", choices=("on", "off"), required=True)
    s.add_argument("--mps-why", default="", help="how .ci/gpu-speed found MPS on or off")
    s.add_argument("--output", required=True)
    args = p.parse_args(argv)
    if args.command == "slug":
        print(device_slug(args.name))
        return 0
    with open(args.bench) as f:
        bench = json.load(f)
    hops = None
    if args.hops:
        try:
            with open(args.hops) as f:
                hops = json.load(f)
        except FileNotFoundError:
            print(f"gpu_speed.py: no {args.hops} (the hop probe did not finish): left out", file=sys.stderr)
    summary = summarize(bench, hops, args.mps == "on", args.mps_why)
    with open(args.output, "w") as f:
        json.dump(summary, f, indent=1)
    print("\n".join(lines(summary)))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
