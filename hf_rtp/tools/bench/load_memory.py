"""Peak resident memory per rank while loading a checkpoint: hf_rtp against transformers, side by side.

    python -m hf_rtp.tools.bench.load_memory --checkpoint /tmp/llama-2gb --world-size 2

Makes a ~2 GB fp32 Llama checkpoint locally if the folder is empty (random weights, written tensor
by tensor), then for each strategy starts fresh processes with MALLOC_MMAP_THRESHOLD_=65536 (so
freed blocks go back to the OS and VmRSS measures the program, not glibc's cache), samples every
process's VmRSS from outside every few milliseconds, and has each process read every local
parameter once after loading (so lazily mapped weights count). Reports peak / checkpoint bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from .processes import run_ranks, vm_rss

STRATEGIES = ("rtp", "tp", "plain")


def make_checkpoint(path: str, layers: int = 8) -> None:
    """A Llama of ~2 GB in fp32 (about 490M parameters), written without ever holding it whole."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_rtp.checkpoint.safetensors_io import StreamingWriter

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        dtype="float32",
    )
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    shapes = [(n, torch.float32, p.shape) for n, p in empty.state_dict().items()]
    os.makedirs(path, exist_ok=True)
    writer = StreamingWriter(os.path.join(path, "model.safetensors.tmp"), shapes, {"format": "pt"})
    gen = torch.Generator().manual_seed(0)
    for name, _, shape in shapes:
        tensor = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        writer.write(name, [tensor])
        del tensor
    writer.close()
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    config.save_pretrained(path)


def measure(strategy: str, checkpoint: str, world_size: int, save_to: str | None = None) -> list[dict]:
    """Start the strategy's processes and return, per rank, its peak VmRSS and what it reported."""
    world = 1 if strategy == "plain" else world_size
    extra = {"HF_RTP_BENCH_SAVE_DIR": save_to} if save_to else None
    reports = run_ranks(
        "hf_rtp.tools.bench.load_memory", ["--child", strategy, "--checkpoint", checkpoint], world, extra_env=extra
    )
    for rank, report in enumerate(reports):
        report.update(rank=rank, peak_rss=max(rss for _, rss in report.pop("rss_samples")))
    return reports


def child(strategy: str, checkpoint: str) -> None:
    """One process of a strategy: import, load, read every local parameter once, report."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    torch.set_num_threads(1)
    baseline = vm_rss(os.getpid())  # everything imported, nothing loaded: what the load adds is on top
    start = time.perf_counter()
    if strategy == "rtp":
        model = hf_rtp.from_pretrained(checkpoint, dtype=torch.float32, device="cpu")
    else:
        extra = {"tp_plan": "auto"} if strategy == "tp" else {}
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **extra)
    load_s = time.perf_counter() - start
    local_bytes, checksum = 0, 0.0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        checksum += float(local.detach().float().sum())
        local_bytes += local.numel() * local.element_size()
    report = {"baseline_rss": baseline, "load_s": load_s, "local_param_bytes": local_bytes}
    save_dir = os.environ.get("HF_RTP_BENCH_SAVE_DIR")
    if strategy == "rtp" and save_dir:
        report.update(_measure_save(model, save_dir))
    print(json.dumps(report), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _measure_save(model, directory: str) -> dict:
    """Peak VmRSS above the pre-save level while save_pretrained gathers and writes (I/O drops the GIL)."""
    before, peak, running = vm_rss(os.getpid()), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], vm_rss(os.getpid()))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model.save_pretrained(directory)
    running[0] = False
    sampler.join()
    return {"save_added_rss": max(peak[0] - before, 0), "save_s": time.perf_counter() - start}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="folder; a ~2 GB Llama is made there if it is empty")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--save-to", help="also time hf_rtp's save_pretrained into this folder and measure its memory")
    p.add_argument("--child", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.checkpoint)
    if not os.path.exists(os.path.join(args.checkpoint, "model.safetensors")):
        print(f"making a ~2 GB Llama checkpoint in {args.checkpoint} ...", flush=True)
        make_checkpoint(args.checkpoint)
    ckpt_bytes = os.path.getsize(os.path.join(args.checkpoint, "model.safetensors"))
    rows = {}
    for strategy in args.strategies.split(","):
        rows[strategy] = measure(strategy, args.checkpoint, args.world_size)
    print(
        f"\ncheckpoint: {ckpt_bytes / 1e9:.2f} GB. Per rank (the worst rank): 'load' is the peak VmRSS above the\n"
        "process's VmRSS just before from_pretrained (torch, transformers, hf_rtp imported); 'process' is the\n"
        "whole peak, import baseline included. Both as fractions of the checkpoint's bytes."
    )
    print(
        f"{'strategy':<8} {'ranks':>5} {'load':>6} {'process':>8} {'peak GB':>8} {'before GB':>9} {'params GB':>9} "
        f"{'load s':>7}"
    )
    for strategy, results in rows.items():
        worst = max(results, key=lambda r: r["peak_rss"] - r["baseline_rss"])
        print(
            f"{strategy:<8} {len(results):>5} {(worst['peak_rss'] - worst['baseline_rss']) / ckpt_bytes:>6.3f} "
            f"{worst['peak_rss'] / ckpt_bytes:>8.3f} {worst['peak_rss'] / 1e9:>8.2f} "
            f"{worst['baseline_rss'] / 1e9:>9.2f} "
            f"{worst['local_param_bytes'] / 1e9:>9.2f} {worst['load_s']:>7.1f}"
        )
    if args.save_to:  # a run of its own: the parent's peak would otherwise mix the save into the load
        rows["rtp_save"] = measure("rtp", args.checkpoint, args.world_size, save_to=args.save_to)
        for r in rows["rtp_save"]:
            print(
                f"hf_rtp save_pretrained, rank {r['rank']}: peak {r['save_added_rss'] / ckpt_bytes:.3f} of the "
                f"checkpoint above its pre-save memory, {r['save_s']:.1f} s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint_bytes": ckpt_bytes, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
