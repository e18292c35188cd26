"""What .ci/gpu's bench stage asserts of `hf-rtp bench`'s results.json (docs/testing.md, "On a GPU").

    python tests/gpu/bench_claims.py benchmarks/results/gpu-check-h100-run11-bench.json

- no strategy failed, and DDP and RTP both ran;
- every strategy's first loss, on each rank, is DDP's on that rank (the same weights and batch before any step:
  float32 rounding, 1e-5 relative; 1e-2 under --autocast, bf16's): a strategy that trained on other data or other
  weights is off by far more;
- RTP's peak memory per rank (`max_memory_allocated` on a GPU, VmRSS above the baseline on the CPU) is below DDP's:
  what RTP is for.

Prints each claim and exits 1 when one fails. test_check_results.py runs it on the stored GPU results.
"""

from __future__ import annotations

import json
import sys

FIRST_LOSS = {False: 1e-5, True: 1e-2}  # relative, by --autocast


def claims(results: dict) -> tuple[list[str], list[str]]:
    """(what holds, what fails), as sentences."""
    held, failed = [], []
    if results.get("failed"):
        failed.append(f"strategies failed: {[(f['strategy'], f['world_size']) for f in results['failed']]}")
    runs = {r["strategy"]: r for r in results["results"] if r["world_size"] >= 2}
    if not {"ddp", "rtp"} <= set(runs):
        return held, [*failed, f"DDP and RTP must both run at 2 ranks or more; ran {sorted(runs)}"]
    tolerance = FIRST_LOSS[bool(results["settings"].get("autocast"))]
    ddp = [rank["losses"][0] for rank in runs["ddp"]["ranks"]]
    for name, run in runs.items():
        first = [rank["losses"][0] for rank in run["ranks"]]
        off = [abs(a - b) / abs(b) for a, b in zip(first, ddp, strict=True)]
        if len(first) == len(ddp) and max(off) <= tolerance:
            held.append(f"{name}: first losses {first} are DDP's (largest relative gap {max(off):.1e})")
        else:
            failed.append(f"{name}: first losses {first} against DDP's {ddp} (relative {tolerance:g} allowed)")
    rtp, ddp_peak = runs["rtp"]["peak_gb"], runs["ddp"]["peak_gb"]
    sentence = f"RTP's peak {rtp:.3f} GB per rank against DDP's {ddp_peak:.3f} GB ({rtp / ddp_peak:.2f}x)"
    (held if rtp < ddp_peak else failed).append(sentence)
    return held, failed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: bench_claims.py RESULTS_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        held, failed = claims(json.load(f))
    for line in held:
        print(f"holds: {line}")
    for line in failed:
        print(f"FAILED: {line}")
    print("bench claims: " + (f"{len(failed)} failed" if failed else f"all {len(held)} hold"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
