"""`hf-rtp bench`: single process, DDP, FSDP2, transformers TP and RTP, side by side in one run.

    hf-rtp bench --preset llama-90m --world-sizes 2,4 --batch 2 --seq 128 --output bench-out

Each strategy runs in fresh processes (one per rank, gloo on CPU) that load the checkpoint, then
train warm-up + measured steps of fp32 AdamW on random tokens. Reported per strategy and world size:
peak memory per rank during training (CPU: VmRSS above the process's size before loading, sampled
from outside every 2 ms; GPU: torch.cuda.max_memory_allocated, and max_memory_reserved beside it), median
step time, global tokens/s,
load time and load peak, memory scaling efficiency, and hf_rtp's estimate beside the measurement.
Writes a table to stdout, results.json and bench.png to --output.
"""

from __future__ import annotations

import argparse

from ..memory import STRATEGIES, dtype_name, tiled_setting
from .presets import PRESETS

# This module is `hf-rtp bench`'s options and help, kept apart from run.py: run.py imports the bench's
# worker, and with it PEFT and bitsandbytes, which `hf-rtp bench --help` has no use for. It imports
# nothing beyond what `import hf_rtp` has imported already (tests/unit/test_public_surface.py).


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`hf-rtp bench`'s options, added to `p` (the `hf-rtp` command's subparser, or parser()'s)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a local checkpoint folder")
    source.add_argument(
        "--preset", choices=sorted(PRESETS), default="llama-90m", help="a config made locally (default llama-90m)"
    )
    p.add_argument("--world-sizes", default="2", help="comma-separated, e.g. 2,4 (default 2)")
    p.add_argument("--strategies", help=f"comma-separated (default {','.join(STRATEGIES)}; with --generate ddp,tp,rtp)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before the measured ones (default 2)")
    p.add_argument("--steps", type=int, default=5, help="measured steps (median reported)")
    p.add_argument(
        "--dtype",
        type=dtype_name,
        default="float32",
        help="the weights' dtype: float32 (default; fp32, float), bfloat16 (bf16), float16 (fp16, half) or float64",
    )
    p.add_argument(
        "--device",
        type=device,
        default="cpu",
        help="cpu: gloo, one process per rank; cuda: NCCL, one GPU per rank (LOCAL_RANK); cuda:N: every rank on GPU "
        "N, as a check on one GPU does (NCCL 2.30 or newer with NCCL_MULTI_RANK_GPU_ENABLE=1, or --backend "
        "cpu:gloo,cuda:gloo) (default cpu)",
    )
    p.add_argument(
        "--backend",
        help="the backend every strategy's ranks start their process group with, as torch.distributed takes it "
        "(gloo, nccl, cpu:gloo,cuda:nccl, ...; default: gloo on cpu, nccl on cuda)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--output", default="bench-out", help="folder for results.json and bench.png")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one strategy may take")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument(
        "--tiled-mlp",
        default="auto",
        type=lambda text: tiled_setting(text) is not None and text,  # refused here, not in a rank: kept as text
        help="from_pretrained's tiled_mlp for the rtp strategies, and their estimates: auto (the default), on, off or "
        "tokens per tile",
    )
    p.add_argument(
        "--rtp-size",
        type=int,
        help="also run RTP as rings of this many ranks (data parallel across "
        "them, the 2-D layout) at every world size it divides, beside the flat ring",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="train (or decode) under bf16 autocast over --dtype "
        "weights, as Trainer(bf16=True) does; FSDP2 then uses its MixedPrecisionPolicy (bf16 gathers)",
    )
    p.add_argument(
        "--fsdp2-prefetch",
        type=int,
        default=0,
        metavar="N",
        help="fsdp2's prefetching: 0 (the default) leaves it to FSDP2's implicit prefetch, as torchtitan's dense "
        "Llama does (in forward the next layer's all-gather is issued when its forward starts, on its own stream; "
        "in backward the next layer in reverse forward order); N >= 1 sets it explicitly, each layer prefetching "
        "the next N in forward and the previous N in backward (set_modules_to_forward_prefetch, "
        "set_modules_to_backward_prefetch)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after the measured steps, one more step under torch.profiler (after one unrecorded) on every rank "
        "of the strategies --profile-strategies names: DIR/STRATEGY-rankR.json.gz (a Chrome trace) and "
        "DIR/STRATEGY-rankR-key-averages.txt; the measured steps and peaks are taken before it",
    )
    p.add_argument("--profile-strategies", default="rtp", help="with --profile: comma-separated (default rtp)")
    p.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA: a frozen NF4 bitsandbytes base with LoRA adapters (r=16, every linear), for ddp, fsdp2 (as "
        "Answer.AI's FSDP-QLoRA: packed bytes stored in --dtype) and rtp; reports ring bytes per step",
    )
    p.add_argument(
        "--generate",
        nargs="?",
        const="1,8,32",
        help="instead: tokens/s and peak memory of greedy "
        "generate at these batch sizes per rank (default 1,8,32) for ddp, tp, rtp, rtp-weights and rtp-whole "
        "(hf_rtp.tools.bench.decode)",
    )
    p.add_argument(
        "--new-tokens", type=int, default=128, help="with --generate or --grpo: tokens each sequence decodes"
    )
    p.add_argument(
        "--grpo",
        action="store_true",
        help="instead: the step time of TRL's GRPOTrainer (generation in-process) for ddp and rtp, prompts of --seq "
        "tokens, --num-generations completions of --new-tokens each (hf_rtp.tools.bench.grpo)",
    )
    p.add_argument("--num-generations", type=int, default=8, help="with --grpo: completions per prompt (per rank)")
    p.add_argument(
        "--long-sequence",
        action="store_true",
        help="instead: one sequence of --seq tokens per context group (batch 1): each rank its own for ddp, "
        "fsdp2 and rtp, one across the ring for rtp-cp (context parallelism), plus rtp-cp on N x --seq tokens "
        "(the tokens RTP trains per step) for time per token; with --budget-gb, each strategy's longest sequence",
    )
    p.add_argument(
        "--hop-cost",
        action="store_true",
        help="instead: the host time of one hop of the ring at tiny shapes, beside a bare loop of the same exchanges "
        "and matmuls, at each of --world-sizes; --steps walks per round (hf_rtp.tools.bench.hops)",
    )
    p.add_argument(
        "--budget-gb",
        type=float,
        help="instead: each strategy's largest batch per rank within this "
        "many GB per rank (estimated, then measured down until it fits), and its tokens/s",
    )


def device(text: str) -> str:
    """--device's value: cpu, cuda, or cuda:N."""
    kind, _, index = text.partition(":")
    if text in ("cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N (every rank on GPU N), got {text!r}")


def parser() -> argparse.ArgumentParser:
    """`hf-rtp bench` on its own, as `hf_rtp.tools.bench.main(argv)` parses its argv."""
    p = argparse.ArgumentParser(
        prog="hf-rtp bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return p
