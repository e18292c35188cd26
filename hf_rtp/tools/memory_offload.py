"""Optimizer state and step in host memory: `hf-rtp estimate --optimizer-offload`'s rows, estimated, not measured.

    hf-rtp estimate ./my-model --world-size 8 --optimizer-offload --gradient-checkpointing --autocast

Three ways to keep the optimizer in host memory, each counted per rank on the device (memory.estimate's rows
`rtp-offload`, `fsdp2-offload`, `zero3-offload`) and in host memory (`host_bytes`, printed per node):

  rtp-offload:   hf_rtp.CPUOffloadOptimizer (model/host_optimizer.py). The device keeps the model's parameters in their
                 own dtype (float32 under "bf16 autocast over float32 weights"; bf16 when the model is loaded in bf16,
                 with float32 masters on the host) and their gradients until step(); the host keeps, for this rank's
                 rows of every trainable parameter, a pinned float32 master, a pinned float32 gradient buffer
                 (the staging the step copies the gradient into), for a bf16 parameter a pinned bf16 copy of its
                 rows (the step compares them with the master, to follow writes) and the optimizer's moments (AdamW:
                 two, float32, pageable: they never cross to the device).
  fsdp2-offload: FSDP2 with CPUOffloadPolicy(pin_memory=True) (accelerate's `cpu_offload`): sharded float32
                 parameters and gradients pinned in host memory, the step on the CPU; the device holds the unsharded
                 root and layers in bf16 (MixedPrecisionPolicy) beside the activations.
  zero3-offload: DeepSpeed ZeRO-3 with offload_optimizer={"device": "cpu"} (parameters stay on the GPU, sharded) and
                 bf16: its own estimator's model states (deepspeed.runtime.zero.stage3's
                 estimate_zero3_model_states_mem_needs: 2 bytes per parameter / N and 4 bytes per parameter of the
                 largest module on the GPU; 16 bytes per parameter / N on the host, to which DeepSpeed's estimator adds
                 a buffer factor of 1.5), plus the buckets Trainer's `auto` config sizes, the activations of a bf16
                 model and the logits, counted as for the other rows.

Pinned host memory comes from torch's CachingHostAllocator, which rounds each request up to a power of two
(ATen/core/CachingHostAllocator.h, unless PYTORCH_CUDA_ALLOC_CONF's pinned_max_round_threshold says otherwise):
`pinned` counts that, tensor by tensor. DeepSpeed pins flat buffers of its own; they are counted unrounded. Not
counted on the host: what each process holds beyond these states (torch's and CUDA's libraries, the dataloader),
and checkpoint offload's layer inputs (`--checkpoint-offload` prints those).

    python -m hf_rtp.tools.memory_offload   # README's table: the two goals of issue 68
"""

from __future__ import annotations

from typing import Any

import torch

from . import memory

# The rows themselves are memory.py's (estimate's `optimizer_offload`, `host_bytes`); this module prints the goals'
# table from them (memory.py does not import it)
from .memory import host_bytes

# Issue 68's goals: bf16 autocast over float32 weights, AdamW, gradient checkpointing, one sequence of 4096 tokens
# per rank, on CUDA; (model, ranks, GB per GPU).
SETTING = dict(batch=1, seq=4096, dtype=torch.float32, autocast=True, gradient_checkpointing=True, device="cuda")
GOALS = (("70B", 8, 80), ("8B", 4, 24))


def goals(dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    """Each goal's estimate: GB per GPU of each offloading strategy (and RTP's without offload), host GB per node."""
    from .cost import llama3

    rows = []
    for size, n, gpu in GOALS:
        config = llama3(size)
        memory.set_attention_implementation(config, "sdpa")
        device = memory.estimate(config, n, **{**SETTING, "dtype": dtype}, optimizer_offload=True)  # type: ignore[arg-type]
        host = host_bytes(config, n, dtype=dtype)
        rows.append(
            {
                "model": f"Llama-3-{size}",
                "ranks": n,
                "gpu_gb": gpu,
                "device_gb": {s: device[s] / 1e9 for s in ("rtp", "fsdp2", *host)},
                "host_gb_per_node": {s: v * n / 1e9 for s, v in host.items()},
            }
        )
    return rows


def table() -> str:
    """README's rows: GB per GPU with host GB per node, for each goal, with float32 and with bf16 weights."""
    lines = [
        "| model, GPUs | weights on the GPU | RTP | RTP + CPUOffloadOptimizer | FSDP2 + CPUOffloadPolicy "
        "| DeepSpeed ZeRO-3 Offload |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for row in goals(dtype):
            d, h = row["device_gb"], row["host_gb_per_node"]
            cells = [f"{d[s]:.1f} ({h[s]:.0f})" for s in ("rtp-offload", "fsdp2-offload", "zero3-offload")]
            lines.append(
                f"| {row['model']}, {row['ranks']} x {row['gpu_gb']} GB | {str(dtype).removeprefix('torch.')} "
                f"| {d['rtp']:.1f} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
