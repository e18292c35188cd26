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

With `--check` (.ci/gpu's long-step stage) it then asserts what the docs claim of these mechanisms (`claims`), and
exits 1 when one fails: on a GPU, tiling lowers the peak, each offload frees at least 90% of the layers' checkpointed
inputs (layers x tokens x hidden x 2 bytes) from what the forward leaves for backward, and both together peak below
either alone; everywhere, offload's gradients are checkpointing's within twice the device's own run-to-run floor (the
second plain run's gap: they copy values, and change none), and tiling's within twice that floor or 2^-6 of the
largest entry, whichever is more (it sums a weight's gradient over tiles in bf16). Step times are printed beside the
1.1x goal and not asserted: a check must not depend on timing.

    python benchmarks/long_step_cuda.py --output benchmarks/results/long-step-h100.json
    python benchmarks/long_step_cuda.py --device cpu --seq 512 --hidden 64 --layers 2 --tile 128 --check  # its own
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


TILED_LEAST = 2.0**-6  # of a gradient's largest entry: bf16 sums of a weight's gradient over a few tiles
FREED = 0.9  # of the layers' checkpointed inputs, which an offload moves to the host


def claims(meta: dict, rows: list[dict]) -> tuple[list[str], list[str]]:
    """(what holds, what fails) of a run's rows, as sentences; memory only where it was measured (a GPU)."""
    by = {r["variant"]: r for r in rows}
    held: list[str] = []
    failed: list[str] = []
    if "checkpointing, again" not in by:
        return held, ["no second plain checkpointing run: no run-to-run floor to read the gaps against"]
    floor = by["checkpointing, again"]["gap"]

    def claim(ok: bool, sentence: str) -> None:
        (held if ok else failed).append(sentence)

    for name, r in by.items():
        if name.startswith("offload"):
            allowed = f"allowed {2 * floor:.2e} (2 x the floor)"
            claim(r["gap"] <= 2 * floor, f"{name}: gradient gap {r['gap']:.2e}, {allowed}")
        elif name.startswith("tiled"):
            limit = max(2 * floor, TILED_LEAST)
            claim(r["gap"] <= limit, f"{name}: gradient gap {r['gap']:.2e}, allowed {limit:.2e}")
    plain = by["checkpointing"]
    if plain["peak_gb"] > 0:  # measured: a GPU
        inputs = meta["layers"] * meta["seq"] * meta["hidden"] * 2 / 1e9
        for name, r in by.items():
            if name.startswith("tiled"):
                claim(r["peak_gb"] < plain["peak_gb"], f"{name}: peak {r['peak_gb']:.3f} GB < {plain['peak_gb']:.3f}")
            if "offload" in name:
                freed = plain["held_gb"] - r["held_gb"]
                claim(freed >= FREED * inputs, f"{name}: frees {freed:.3f} GB for backward of {inputs:.3f} GB inputs")
        both = by.get("tiled + offload (hf_rtp)")
        if both is not None:
            alone = min(by["tiled"]["peak_gb"], by["offload (hf_rtp)"]["peak_gb"])
            sentence = f"tiled + offload: peak {both['peak_gb']:.3f} GB < either alone's {alone:.3f}"
            claim(both["peak_gb"] < alone, sentence)
    return held, failed


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
    parser.add_argument("--check", action="store_true", help="assert the claims (see above); exit 1 when one fails")
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
    meta = dict(vars(args), torch=torch.__version__, device_name=str(device))
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    tiled = next(r for r in rows if r["variant"] == "tiled")
    print(f"tiling: {tiled['step_s'] / first['step_s']:.3f}x plain checkpointing's step (goal 1.1x, not asserted)")
    if args.check:
        held, failed = claims(meta, rows)
        for line in held:
            print(f"holds: {line}")
        for line in failed:
            print(f"FAILED: {line}")
        print("long-step claims: " + (f"{len(failed)} failed" if failed else f"all {len(held)} hold"))
        if failed:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
