"""The main job on the embedded default: make a tiny Llama locally, train it with hf_rtp, save it.

    torchrun --nproc_per_node 2 recipes/quickstart.py                       # plain loop + sync_grads
    accelerate launch --config_file recipes/configs/cpu.yaml recipes/quickstart.py --use_accelerate
    python recipes/quickstart.py                                            # one process

Every rank trains on its own byte-level windows of recipes/data/tiny_corpus.txt (no tokenizer or
download needed), holds 1/N of the weights, and the result is a standard checkpoint that vanilla
transformers loads; the script checks that at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_rtp

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 256  # bytes


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="outputs/quickstart")
    p.add_argument("--corpus", default=os.path.join(HERE, "data", "tiny_corpus.txt"))
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--per_device_batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--use_accelerate", action="store_true", help="wrap with accelerator.prepare (DDP) instead of sync_grads")
    return p.parse_args()


def make_base_checkpoint(path: str, seed: int) -> None:
    """A tiny Llama with grouped-query attention, written once by the first process to get here."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )
    staging = f"{path}.tmp-{os.getpid()}"
    AutoModelForCausalLM.from_config(config).save_pretrained(staging)
    os.replace(staging, path)


def batches(corpus: bytes, rank: int, args):
    """This rank's own stream of random windows: ranks see different data, as in data parallelism."""
    data = torch.tensor(list(corpus), dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    while True:
        starts = torch.randint(0, len(data) - args.seq_len, (args.per_device_batch_size,), generator=gen)
        yield torch.stack([data[s : s + args.seq_len] for s in starts])


def main():
    args = parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    base = os.path.join(args.output_dir, "base")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        make_base_checkpoint(base, args.seed)

    accelerator = None
    if args.use_accelerate:
        from accelerate import Accelerator

        # Without CUDA, accelerate must be told to use the CPU or it runs undistributed (design §5).
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
    elif world > 1:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    if world > 1:
        dist.barrier()  # rank 0 has written the base checkpoint

    model = hf_rtp.from_pretrained(base, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    trained = model
    if accelerator is not None:
        trained, optimizer = accelerator.prepare(model, optimizer)

    with open(args.corpus, "rb") as f:
        stream = batches(f.read(), rank, args)
    losses, start = [], time.perf_counter()
    for step in range(1, args.max_steps + 1):
        ids = next(stream).to(next(model.parameters()).device)
        loss = trained(input_ids=ids, labels=ids).loss
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
            hf_rtp.sync_grads(model)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        losses.append(mean_loss.item())
        if rank == 0 and (step == 1 or step % 5 == 0 or step == args.max_steps):
            tokens = step * world * ids.numel()
            print(
                f"step {step:3d}  loss {losses[-1]:.4f}  grad_norm {float(grad_norm):.3f}  "
                f"tokens/s {tokens / (time.perf_counter() - start):.0f}",
                flush=True,
            )

    final = os.path.join(args.output_dir, "final")
    model.save_pretrained(final)
    if rank == 0:
        vanilla = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
        held = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        ) / sum(p.numel() for p in model.parameters())
        summary = {"world_size": world, "losses": losses, "rank0_param_share": held, "saved": final}
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} on {world} process(es); rank 0 held "
            f"{held:.0%} of the parameters; {final} loads in vanilla transformers "
            f"({sum(p.numel() for p in vanilla.parameters()):,} parameters)",
            flush=True,
        )
        assert math.isfinite(losses[-1])
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
