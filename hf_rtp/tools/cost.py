"""What each strategy sends per training step and holds per GPU across nodes: the cost model of docs/multi-node.md.

    python -m hf_rtp.tools.cost      # docs/multi-node.md's table: Llama-3-8B and 70B on nodes of 8 GPUs

Mixed precision as people train (Trainer(bf16=True): float32 master weights, bf16 autocast): weights
travel in bf16 (S bytes, 2 per parameter), gradients in float32 (G = 2S, hf_rtp's and FSDP2's
default reduce_dtype). Per rank and optimizer step:
  RTP, rings of K: every chunk walks its ring in forward and again in backward (K-1 hops of S/K),
      and the other ranks' gradient for it travels K-1 hops home: (2S + G)(K-1)/K to the ring
      neighbour, what FSDP2 with MixedPrecisionPolicy(bf16, float32) sends over K ranks. With
      replicas, each rank's chunk of the gradient is then all-reduced over them: 2(D-1)/D * G/K.
  FSDP2 over W ranks: two all-gathers of S and a reduce-scatter of G, each (W-1)/W of it. HSDP shards
      over K and all-reduces each rank's G/K gradient over the D = W/K replicas.
Where the bytes go: a ring of K consecutive ranks stays inside a node when K divides the GPUs per node;
otherwise K/N of its hops cross the network, one NIC per node boundary, and since every hop of a ring
step waits for the slowest, all of it runs at network speed. NCCL's collectives over several nodes
run one ring per NIC, so an FSDP2 collective of V bytes puts about V(W-1)/W/N through each GPU's NIC.
Replicas of one chunk sit on different nodes (one per node when K = N): their all-reduce is inter-node.
Time is the larger of the NVLink and the network transfer, for every strategy: their collectives on
the two links overlap (RTP's all-reduce over replicas starts once autograd has a layer's gradient and
runs during earlier layers' backward, distributed/tensors/replicas.py). It does not count what hides behind compute.
Memory is model states only (float32 weights and gradients and two AdamW moments: 16 bytes per
parameter) plus what a step holds unsharded beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

NVLINK_BYTES_S = 450e9  # per GPU, one direction (H100 SXM)
NETWORK_BYTES_S = 50e9  # 400 Gb/s per GPU
STATE_BYTES = 16  # per parameter: bf16 weight and gradient, float32 master weight and two AdamW moments
WEIGHT_BYTES = 2  # per parameter on the wire: bf16 weights (autocast's dtype)
GRAD_BYTES = 4  # float32 gradients (reduce_dtype)
# RTP's rotation slots: two weight and two gradient pieces of 16 MB (the embedding's lookup walks
# float32 rows, so its pieces, not the halved bf16 ones, size the weight slots)
POOL_BYTES = 4 * 16e6


@dataclass(frozen=True)
class Cost:
    intra: float
    """bytes per rank per step over NVLink"""
    inter: float
    """bytes per rank per step over the network (per NIC)"""
    memory: float
    """bytes per GPU: sharded states and what a step holds unsharded"""
    ring_crosses_nodes: bool = False
    links_overlap: bool = True
    """whether the two links' transfers run at once (all strategies here; kept for what-ifs)"""

    @property
    def seconds(self) -> float:
        if self.ring_crosses_nodes:  # lockstep ring: every hop at network speed
            return (self.intra + self.inter) / NETWORK_BYTES_S
        nvlink, network = self.intra / NVLINK_BYTES_S, self.inter / NETWORK_BYTES_S
        return max(nvlink, network) if self.links_overlap else nvlink + network


def rtp(params: int, world: int, per_node: int, rtp_size: int | None = None) -> Cost:
    k = world if rtp_size is None else rtp_size
    replicas, s, g = world // k, params * WEIGHT_BYTES, params * GRAD_BYTES
    ring = (2 * s + g) * (k - 1) / k
    reduce = 2 * (replicas - 1) / replicas * g / k
    crosses = k > per_node or per_node % k != 0
    memory = params * STATE_BYTES / k + POOL_BYTES
    if crosses:
        return Cost(0.0, ring + reduce, memory, ring_crosses_nodes=True)
    return Cost(ring, reduce, memory)


def fsdp(params: int, world: int, per_node: int, layer_params: int, shard_size: int | None = None) -> Cost:
    """FSDP2 (shard_size None: over all ranks) or HSDP (shard over shard_size, replicate the rest)."""
    k = world if shard_size is None else shard_size
    replicas, s, g = world // k, params * WEIGHT_BYTES, params * GRAD_BYTES
    gathers = (2 * s + g) * (k - 1) / k
    nodes_in_shard = math.ceil(k / per_node)
    inter = gathers / per_node if nodes_in_shard > 1 else 0.0  # one NCCL ring per NIC
    intra = gathers if nodes_in_shard == 1 else gathers * (1 - 1 / per_node)
    inter += 2 * (replicas - 1) / replicas * g / k
    # two layers' weights unsharded (the one running, the one prefetched) and one layer's gradient
    memory = params * STATE_BYTES / k + layer_params * (2 * WEIGHT_BYTES + GRAD_BYTES)
    return Cost(intra, inter, memory)


def strategies(params: int, layer_params: int, nodes: int, per_node: int) -> dict[str, Cost]:
    world = nodes * per_node
    return {
        "RTP, one flat ring": rtp(params, world, per_node),
        f"RTP, rings of {per_node} (2-D)": rtp(params, world, per_node, per_node),
        "FSDP2": fsdp(params, world, per_node, layer_params),
        f"HSDP, shards of {per_node}": fsdp(params, world, per_node, layer_params, per_node),
    }


def llama3(size: str):
    from transformers import LlamaConfig

    shapes: dict[str, dict[str, Any]] = {
        "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
        "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    }
    return LlamaConfig(vocab_size=128256, num_key_value_heads=8, **shapes[size])


def counts(config) -> tuple[int, int]:
    """(parameters, parameters of one decoder layer), from the config on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from .memory import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = decoder_layers(model)[0]
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in layer.parameters())


def table(sizes=("8B", "70B"), nodes=(1, 2, 4), per_node: int = 8) -> str:
    rows = [
        "| model | nodes x GPUs | strategy | NVLink GB/rank | network GB/rank | comm s/step "
        "| states + unsharded GB/GPU |",
        "|---|---|---|--:|--:|--:|--:|",
    ]
    for size in sizes:
        params, layer = counts(llama3(size))
        for m in nodes:
            for name, cost in strategies(params, layer, m, per_node).items():
                if m == 1 and name.startswith(("RTP, rings", "HSDP")):
                    continue  # the same as the flat ones inside one node
                pace = " (ring at network speed)" if cost.ring_crosses_nodes else ""
                rows.append(
                    f"| Llama-3-{size} | {m} x {per_node} | {name} | {cost.intra / 1e9:.1f} | "
                    f"{cost.inter / 1e9:.1f}{pace} | {cost.seconds:.2f} | {cost.memory / 1e9:.1f} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
