"""Per-rank QLoRA memory from config.json alone: a frozen 4-bit base (bitsandbytes NF4), LoRA adapters on
every linear layer, AdamW on the adapters; under DDP, FSDP2 as Answer.AI's FSDP-QLoRA shards it, and RTP.

    hf-rtp estimate ./my-model --world-size 4 --load-in-4bit

The base's linear layers in the decoder hold half a byte per weight plus their quantization state (one
scale per 64 weights: float32, or with double quantization one byte and a float32 per 256 scales); what
stays unquantized (embeddings, norms, the LM head) is in `dtype`: float32 once `prepare_model_for_kbit_training`
has run, as PEFT's recipe runs it, bf16 in FSDP-QLoRA recipes. The strategies differ in what a rank holds:

  ddp:   the whole base, the adapters, their gradients (twice: DDP's buckets) and AdamW state;
  fsdp2: 1/N of the packed bytes (stored as bf16 so FSDP shards them) and of the unquantized weights and
         adapters, but every rank keeps every layer's quantization state whole, and gathers the root
         (embeddings, head) and a decoder layer at a time;
  rtp:   1/N of the packed rows with their own scales (float32: hf_rtp dequantizes double quantization's
         scales once, at load) and 1/N of the unquantized weights; the adapters,
         a few MB, are replicated as hf_rtp replicates every small parameter; the ring's slots hold a
         piece of packed rows at a time.

Activations are the full fine-tuning ones (memory.py's meta forward): each LoRA layer keeps its input as
a trained linear layer would. Checked against two measurements (tests/unit/test_memory_estimate.py):
- PEFT's published FSDP-QLoRA run of Llama-2-70B on 2 GPUs, 35.6 GB per GPU: the FSDP2 estimate is 31.8 GB with
  CUDA's terms (memory.CUDA: the CUDA context, NCCL's buffers, cuBLAS's workspaces; 30.9 GB without them), 11%
  below it;
- `hf-rtp bench --load-in-4bit` on the 90M preset at 2 and 4 ranks (host VmRSS, CPU): FSDP2 1.01x the measured
  peak, DDP 0.82x (its measured peak holds checkpoint pages vanilla's load leaves mapped), RTP 1.24-1.28x (its
  fixed per-step buffers, ~110 MB, are not all alive at once); the RTP estimate errs high.

    python -m hf_rtp.tools.memory_qlora   # docs/benchmarks.md's table: Llama-3 8B and 70B, 2 to 8 ranks
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import memory, speed_report

BLOCK = 64  # bitsandbytes' 4-bit block: one scale per 64 weights
NESTED_BLOCK = 256  # double quantization: one float32 per 256 scales
DEQUANTIZED_TEMPORARIES = 2  # a dequantized weight (forward) and its transposed use in backward, at a time


def scale_bytes_per_weight(double_quant: bool) -> float:
    """The quantization state's bytes per quantized weight (scales, and their scales)."""
    return (1 + 4 / NESTED_BLOCK) / BLOCK if double_quant else 4 / BLOCK


def _quantized(layer: nn.Module) -> list[nn.Linear]:
    """The linear layers bitsandbytes quantizes: every one in a decoder layer (not the LM head)."""
    return [m for m in layer.modules() if isinstance(m, nn.Linear)]


def estimate_qlora(
    config,
    world_size: int,
    *,
    batch: int = 2,
    seq: int = 128,
    lora_rank: int = 16,
    double_quant: bool = True,
    gradient_checkpointing: bool = False,
    dtype: str | torch.dtype = "auto",
    compute_dtype: str | torch.dtype | None = None,
    piece_bytes: int = 16 * 10**6,
    device: str = "cpu",
    tiled_mlp: bool | int | str = "auto",
    checkpoint_offload: bool = False,
) -> dict[str, float]:
    """Estimated peak bytes per rank of QLoRA training under DDP, FSDP2 (FSDP-QLoRA) and RTP. `dtype`: the
    unquantized weights, adapters and activations (float32 once prepare_model_for_kbit_training has run, as PEFT's
    recipe runs it; bfloat16 where the model is loaded so and that step skipped, as FSDP-QLoRA recipes do);
    `compute_dtype`: bnb_4bit_compute_dtype, what a dequantized weight is held in (default: `dtype`); `device`:
    "cpu" or "cuda", what memory.estimate's `device` says; `tiled_mlp` and `checkpoint_offload` (with
    `gradient_checkpointing`): the RTP row with from_pretrained's tiled_mlp and hf_rtp's checkpoint offload, as
    memory.estimate counts them."""
    terms = memory.device_terms(device)
    weights = memory._dtype(dtype, config)
    compute = memory._dtype(compute_dtype, config) if compute_dtype is not None else weights
    model = memory._meta_model(config, weights)
    width = weights.itemsize
    n = world_size
    layers = memory.decoder_layers(model)
    linears = [m for layer in layers for m in _quantized(layer)]
    quantized_ids = {id(m.weight) for m in linears}
    q_elems = sum(m.weight.numel() for m in linears)
    packed, scales = q_elems / 2, q_elems * scale_bytes_per_weight(double_quant)
    floats = sum(p.numel() for p in model.parameters() if id(p) not in quantized_ids) * width
    lora = sum(lora_rank * (m.in_features + m.out_features) for m in linears) * width
    largest = max((m.weight.numel() for m in linears), default=0) * compute.itemsize
    activations = memory._activations(model, batch, seq, True, gradient_checkpointing)
    logits = batch * seq * config.vocab_size * 4
    adapters = 4 * lora  # weight, gradient, two AdamW moments
    working = DEQUANTIZED_TEMPORARIES * largest + terms.in_allocator

    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers) * width
    layer_packed = max((sum(m.weight.numel() for m in _quantized(layer)) for layer in layers), default=0) / 2

    ddp = packed + scales + floats + adapters + lora + activations + 2 * logits + working
    fsdp2 = (
        (packed + floats + adapters) / n
        + scales  # the quantization state stays whole on every rank
        + root
        + 2 * layer_packed  # a gathered layer, and the next one prefetched
        + activations
        + 2 * logits
        + working
    )
    if n == 1:
        alone = {"ddp": ddp, "fsdp2": ddp - lora, "rtp": ddp - lora}
        return {s: v + memory.outside_allocator(s, 1, device) for s, v in alone.items()}
    slot = min(piece_bytes, math.ceil(max(root, 2 * layer_packed) / n))  # a piece of packed rows or floats
    pool = (1 if n == 2 else 2) * slot
    fused = (
        memory._activations(model, batch, seq, False, gradient_checkpointing, tiled_mlp, checkpoint_offload)
        + batch * seq * (config.hidden_size * width + 8)
        + 3 * min(terms.loss_tile, batch * seq * math.ceil(config.vocab_size / n) * 4)
    )
    # hf_rtp keeps each rank's scales as float32 (double quantization dequantized once, at load)
    rtp = (packed + q_elems * 4 / BLOCK + floats) / n + adapters + pool + fused + working
    return {s: v + memory.outside_allocator(s, n, device) for s, v in {"ddp": ddp, "fsdp2": fsdp2, "rtp": rtp}.items()}


# The setting of PEFT's published FSDP-QLoRA run (docs/source/accelerate/fsdp.md, "Memory usage"): Llama-2-70B on
# 2 GPUs, 2 sequences of 2048 tokens per GPU, gradient checkpointing, flash attention, LoRA r=8 on every linear
# layer, NF4 with double quantization, bf16 weights and compute: 35.6 GB per GPU without CPU offload.
PUBLISHED = dict(batch=2, seq=2048, lora_rank=8, gradient_checkpointing=True, dtype="bfloat16")
PUBLISHED_FSDP_QLORA_GB = 35.6


def llama2_70b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    )


def table(world_sizes=(2, 4, 8)) -> str:
    """docs/benchmarks.md's QLoRA estimate for Llama-3 8B and 70B on GPUs, in PEFT's published setting."""
    from .cost import llama3

    rows = [
        "| model | ranks | DDP + QLoRA | FSDP-QLoRA | hf_rtp | hf_rtp / FSDP-QLoRA |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    named = [("Llama-2-70B", llama2_70b())] + [(f"Llama-3-{size}", llama3(size)) for size in ("8B", "70B")]
    for name, config in named:
        memory.set_attention_implementation(config, "sdpa")  # flash attention's memory: no [seq, seq] scores
        for n in world_sizes if name != "Llama-2-70B" else (2,):
            e = estimate_qlora(config, n, **PUBLISHED, device="cuda")  # type: ignore[arg-type]
            rows.append(
                f"| {name} | {n} | {e['ddp'] / 1e9:.1f} | {e['fsdp2'] / 1e9:.1f} | {e['rtp'] / 1e9:.1f} "
                f"| {e['rtp'] / e['fsdp2']:.2f}x |"
            )
    return "\n".join(rows)


def parser():
    """`hf-rtp estimate`'s parser: memory's options and --speed's."""
    p = memory.parser()
    speed_report.add_arguments(p)
    return p


def main(argv=None) -> dict:
    """`hf-rtp estimate`: with --speed the step time (speed_report.report), with --load-in-4bit QLoRA's memory, else
    full fine-tuning's (memory.main)."""
    args = parser().parse_args(argv)
    if args.speed:
        return speed_report.report(args)
    if args.json:
        raise SystemExit("hf-rtp estimate: --json prints --speed's report: add --speed")
    if not args.load_in_4bit:
        return memory.main(args=args)
    if args.world_size < 1:
        raise SystemExit("--world-size must be at least 1")
    if args.rtp_size is not None or args.optimizer != "adamw" or args.autocast or args.optimizer_offload:
        raise SystemExit(
            "--load-in-4bit estimates one flat ring with AdamW on the adapters, without --autocast or "
            "--optimizer-offload"
        )
    if args.lora_rank < 1:
        raise SystemExit("--lora-rank must be at least 1")
    if args.checkpoint_offload and not args.gradient_checkpointing:
        raise SystemExit("--checkpoint-offload moves what gradient checkpointing keeps: add --gradient-checkpointing")
    config = memory.config_from(args)
    dtype, source = memory.resolved_dtype(args, config)
    result = estimate_qlora(
        config,
        args.world_size,
        batch=args.batch,
        seq=args.seq,
        lora_rank=args.lora_rank,
        gradient_checkpointing=args.gradient_checkpointing,
        dtype=dtype,
        device=args.device,
        tiled_mlp=args.tiled_mlp,
        checkpoint_offload=args.checkpoint_offload,
    )
    print(
        f"{config.model_type}: QLoRA (NF4 base, LoRA r={args.lora_rank} on every linear layer, AdamW; unquantized "
        f"weights in {memory.dtype_note(dtype, source)}); "
        f"batch {args.batch}x{args.seq} per rank, {args.world_size} rank(s)"
    )
    notes = {"fsdp2": "   (FSDP-QLoRA: packed bytes sharded, quantization state whole)", "rtp": "   (fused loss)"}
    for strategy, value in result.items():
        print(f"  {strategy:<11} {value / 1e9:7.3f} GB per rank" + notes.get(strategy, ""))
    if args.checkpoint_offload:
        inputs = memory.checkpointed_inputs(memory._meta_model(config, dtype), args.batch, args.seq)
        per_node = min(args.gpus_per_node, args.world_size)
        print(f"  checkpoint offload, pinned host memory per node of {per_node} GPUs: {inputs * per_node / 1e9:.1f} GB")
    return result


if __name__ == "__main__":
    print(table())
