"""What each strategy sends per training step and holds per GPU across nodes: the README's cost model.

    python -m hf_rtp.tools.cost      # the README's table: Llama-3-8B and 70B on nodes of 8 GPUs

Per rank and optimizer step, for S bytes of parameters (gradients travel in the same dtype):
  RTP, rings of K: every chunk walks its ring in forward and again in backward (K-1 hops of S/K),
      and the other ranks' gradient for it travels K-1 hops home: 3S(K-1)/K to the ring neighbour,
      what FSDP2 sends over K ranks. With replicas,
      each rank's chunk of the gradient is then all-reduced over them: 2(D-1)/D * S/K.
  FSDP2 over W ranks: two all-gathers and a reduce-scatter of S, S(W-1)/W each. HSDP shards over K
      and all-reduces each rank's S/K gradient over the D = W/K replicas.
Where the bytes go: a ring of K consecutive ranks stays inside a node when K divides the GPUs per node;
otherwise K/N of its hops cross the network, one NIC per node boundary, and since every hop of a ring
step waits for the slowest, all of it runs at network speed. NCCL's collectives over several nodes
run one ring per NIC, so an FSDP2 collective of V bytes puts about V(W-1)/W/N through each GPU's NIC.
Replicas of one chunk sit on different nodes (one per node when K = N): their all-reduce is inter-node.
Time is the NVLink transfer plus the network transfer for RTP, whose all-reduce over replicas waits
for each layer's ring walk to finish (hf_rtp overlaps it only with the walk of a chunk's later
pieces), and the larger of the two for FSDP2 and HSDP, whose collectives on the two links overlap;
neither counts what hides behind compute. Memory is model states only (bf16 weights and gradients, float32 master weights
and AdamW moments: 16 bytes per parameter) plus what a step holds unsharded beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NVLINK_BYTES_S = 450e9  # per GPU, one direction (H100 SXM)
NETWORK_BYTES_S = 50e9  # 400 Gb/s per GPU
STATE_BYTES = 16  # per parameter: bf16 weight and gradient, float32 master weight and two AdamW moments
TRAVEL_BYTES = 2  # bf16 weights and gradients on the wire
POOL_BYTES = 4 * 16e6  # RTP's rotation slots: two weight and two gradient pieces of 16 MB


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
    """False for RTP: a layer's all-reduce over replicas starts when its ring walk ends"""

    @property
    def seconds(self) -> float:
        if self.ring_crosses_nodes:  # lockstep ring: every hop at network speed
            return (self.intra + self.inter) / NETWORK_BYTES_S
        nvlink, network = self.intra / NVLINK_BYTES_S, self.inter / NETWORK_BYTES_S
        return max(nvlink, network) if self.links_overlap else nvlink + network


def rtp(params: int, world: int, per_node: int, rtp_size: int | None = None) -> Cost:
    k = world if rtp_size is None else rtp_size
    replicas, s = world // k, params * TRAVEL_BYTES
    ring = 3 * s * (k - 1) / k
    reduce = 2 * (replicas - 1) / replicas * s / k
    crosses = k > per_node or per_node % k != 0
    memory = params * STATE_BYTES / k + POOL_BYTES
    if crosses:
        return Cost(0.0, ring + reduce, memory, ring_crosses_nodes=True)
    return Cost(ring, reduce, memory, links_overlap=False)


def fsdp(params: int, world: int, per_node: int, layer_params: int, shard_size: int | None = None) -> Cost:
    """FSDP2 (shard_size None: over all ranks) or HSDP (shard over shard_size, replicate the rest)."""
    k = world if shard_size is None else shard_size
    replicas, s = world // k, params * TRAVEL_BYTES
    gathers = 3 * s * (k - 1) / k
    nodes_in_shard = math.ceil(k / per_node)
    inter = gathers / per_node if nodes_in_shard > 1 else 0.0  # one NCCL ring per NIC
    intra = gathers if nodes_in_shard == 1 else gathers * (1 - 1 / per_node)
    inter += 2 * (replicas - 1) / replicas * s / k
    # two layers' weights unsharded (the one running, the one prefetched) and one layer's gradient
    memory = params * STATE_BYTES / k + 3 * layer_params * TRAVEL_BYTES
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

    shapes = {"8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
              "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)}
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
    rows = ["| model | nodes x GPUs | strategy | NVLink GB/rank | network GB/rank | comm s/step "
            "| states + unsharded GB/GPU |", "|---|---|---|--:|--:|--:|--:|"]
    for size in sizes:
        params, layer = counts(llama3(size))
        for m in nodes:
            for name, cost in strategies(params, layer, m, per_node).items():
                if m == 1 and name.startswith(("RTP, rings", "HSDP")):
                    continue  # the same as the flat ones inside one node
                pace = " (ring at network speed)" if cost.ring_crosses_nodes else ""
                rows.append(f"| Llama-3-{size} | {m} x {per_node} | {name} | {cost.intra / 1e9:.1f} | "
                            f"{cost.inter / 1e9:.1f}{pace} | {cost.seconds:.2f} | {cost.memory / 1e9:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
