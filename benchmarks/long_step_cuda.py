"""What tiled MLP and checkpoint offload cost on one GPU, at a long sequence (issue 52's point 4; .ci/gpu's
long-step stage): one forward and backward of a 470M Llama (8 layers of Llama-3-8B's 2048-wide shape family) on
32768 tokens in bf16 under gradient checkpointing, five ways in one process on the same values:

- checkpointing: transformers' own `activation_checkpointing_enable()`, run twice (the second run's gradient gap is
  the device's run-to-run floor);
- tiled: hf_rtp's tiled MLP (model/tiled_mlp.py) in tiles of 8192 tokens;
- offload (transformers): `activation_checkpointing_enable(offload=True)` as transformers runs it (torch's
  `save_on_cpu`, copies on the compute stream);
- offload (hf_rtp): the same switch as hf_rtp runs it (model/offload.py: pinned host memory, a side stream);
- tiled + offload (hf_rtp).

For each: the mean step time of `--steps` steps after one warm-up, the peak allocated memory, what the forward
leaves allocated for backward, and the largest gradient gap to plain checkpointing's (relative to that gradient's
largest entry: tiling sums its weight gradients over tiles; offload copies values and changes none). Prints a table
of ratios to plain checkpointing and writes it as JSON. No ring: this is the single-GPU cost of each mechanism; on
a ring each tile is also a walk of the MLP's weights.

    python benchmarks/long_step_cuda.py --output benchmarks/results/long-step-h100.json
    python benchmarks/long_step_cuda.py --device cpu --seq 512 --hidden 64 --layers 2 --tile 128  # its own check
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _variant(base, name: str, device: torch.device, tile: int):
    from hf_rtp.model import offload, tiled_mlp

    model = copy.deepcopy(base).train()
    if "tiled" in name:
        tiled_mlp.install(model, tile)
    if name == "offload (transformers)":
        model.activation_checkpointing_enable(offload=True)
    elif "offload" in name:
        offload.install(model, device)
        model.activation_checkpointing_enable(offload=True)
    else:
        model.activation_checkpointing_enable()
    return model


def _step(model, ids, device: torch.device) -> tuple[float, int, int]:
    """(seconds, bytes the forward leaves for backward, peak bytes) of one forward and backward."""
    for p in model.parameters():
        p.grad = None
    _sync(device)
    before = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    _sync(device)
    held = _allocated(device) - before
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    return seconds, held, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tile", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig

    device = torch.device(args.device)
    heads = max(1, args.hidden // 128)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=args.vocab,
        max_position_embeddings=args.seq, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with device:
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(0, args.vocab, (1, args.seq), device=device)
    # plain checkpointing twice: the second's gradient gap is this device's run-to-run floor (bf16 kernels that
    # accumulate with atomics), against which the others' gaps read
    names = ["checkpointing", "checkpointing, again", "tiled", "offload (transformers)", "offload (hf_rtp)"]
    names.append("tiled + offload (hf_rtp)")
    if device.type != "cuda":
        names = names[:3]  # offload moves a GPU's activations to the host: nothing to move on the CPU
    rows, reference = [], None
    for name in names:
        model = _variant(base, name, device, args.tile)
        _step(model, ids, device)  # warm-up: kernels chosen, pinned host blocks cached
        runs = [_step(model, ids, device) for _ in range(args.steps)]
        grads = {n: p.grad for n, p in model.named_parameters()}
        if reference is None:
            reference, gap = grads, 0.0
        else:
            gap = max(
                (
                    (g.float() - reference[n].float()).abs().max() / reference[n].float().abs().max().clamp_min(1e-30)
                ).item()
                for n, g in grads.items()
            )
        seconds = sum(r[0] for r in runs) / len(runs)
        rows.append(dict(variant=name, step_s=seconds, held_gb=runs[-1][1] / 1e9, peak_gb=runs[-1][2] / 1e9, gap=gap))
        del model, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = rows[0]
    print(
        f"Llama {args.hidden} wide, {args.layers} layers, vocab {args.vocab}, {args.seq} tokens, bf16, "
        f"tiles of {args.tile}, on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}"
    )
    print(f"{'variant':26} {'step s':>7} {'x ckpt':>7} {'held GB':>8} {'peak GB':>8} {'x peak':>7} {'grad gap':>9}")
    for r in rows:
        time_ratio = r["step_s"] / first["step_s"]
        peak_ratio = r["peak_gb"] / first["peak_gb"] if first["peak_gb"] else float("nan")
        print(
            f"{r['variant']:26} {r['step_s']:7.3f} {time_ratio:7.3f} {r['held_gb']:8.3f} {r['peak_gb']:8.3f} "
            f"{peak_ratio:7.3f} {r['gap']:9.2e}"
        )
    if args.output:
        meta = dict(vars(args), torch=torch.__version__, device_name=str(device))
        if device.type == "cuda":
            meta["device_name"] = torch.cuda.get_device_name(device)
        with open(args.output, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
