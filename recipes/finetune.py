"""Causal-LM fine-tuning with hf_rtp: every rank trains on its own data and holds 1/N of the model.

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/finetune.py   # 2 CPU processes
    torchrun --nproc_per_node 2 recipes/finetune.py
    python recipes/finetune.py                                                     # 1 process
    ... recipes/finetune.py --vanilla   # the same run on plain transformers and DDP, to compare with

With no flags it trains the embedded default (recipes/defaults.py: a small Llama, its tokenizer and
a synthetic dataset, made locally). It writes output_dir/metrics.jsonl (one line per optimizer
step), output_dir/checkpoint-{step} every --save_every steps (resume with --resume_from), and at
the end a standard checkpoint in output_dir/final that vanilla transformers loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the recipes' own helpers

from defaults import make_default
from packing import GlobalOrder, load_texts, pack, split_eval

import hf_rtp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder or Hub id (default: the embedded tiny Llama)")
    p.add_argument("--dataset", help="json/jsonl/text/parquet file or Hub dataset (default: embedded)")
    p.add_argument("--eval_dataset", help="file for eval loss (default: 5%% of --dataset, or the embedded eval set)")
    p.add_argument("--text_column", default="text")
    p.add_argument("--output_dir", default="outputs/finetune")
    p.add_argument("--max_steps", type=int, default=60)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup_steps", type=int, default=5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--save_every", type=int, default=0, help="write output_dir/checkpoint-{step} every N steps")
    p.add_argument("--resume_from", help="a checkpoint-{step} folder written by this recipe")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT) on the frozen rotated base")
    p.add_argument("--lora_r", type=int, default=8)
    bits = p.add_mutually_exclusive_group()
    bits.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: a frozen NF4 base (bitsandbytes, double quantization) with LoRA adapters; implies --lora",
    )
    bits.add_argument(
        "--load_in_8bit",
        action="store_true",
        help="a frozen LLM.int8() base (bitsandbytes' default threshold) with LoRA adapters; implies --lora",
    )
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--no_bf16", action="store_true", help="on GPU, train without bf16 autocast")
    p.add_argument("--push_to_hub", metavar="REPO", help="upload output_dir/final to this Hub repo at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rtp_size",
        type=int,
        help="ranks per ring (default: all; e.g. GPUs per node for one ring per node, data parallel across nodes)",
    )
    p.add_argument(
        "--vanilla",
        action="store_true",
        help="the same run on plain transformers and DDP (every rank a whole model), to compare hf_rtp with: "
        "metrics.jsonl and final/ as hf_rtp's run writes them",
    )
    p.add_argument(
        "--context_parallel",
        action="store_true",
        help="long context: cut each sequence across the ring (hf_rtp.context_parallel); the ranks of a ring train "
        "the same micro-batch, each ring its own",
    )
    return p.parse_args(argv)


VANILLA_REFUSES = ("load_in_4bit", "load_in_8bit", "context_parallel", "rtp_size", "resume_from", "save_every")


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup, set_seed

    if args.vanilla and any(getattr(args, name) for name in VANILLA_REFUSES):
        raise SystemExit(f"--vanilla compares the plain run: leave out {', '.join('--' + n for n in VANILLA_REFUSES)}")
    if args.vanilla:  # accelerate's own Accelerator, as a plain transformers script builds it
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
    else:
        # accelerate's Accelerator, with cpu=True when there is no CUDA (else a multi-process launch
        # runs undistributed) and save_state/load_state made collective for rotated models.
        accelerator = hf_rtp.Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    with accelerator.main_process_first():  # rank 0 makes the default files, the others then read them
        if args.model is None or args.dataset is None:
            default_model, default_train, default_eval = make_default(
                os.path.join(args.output_dir, "default"), args.seed
            )
        model_path = args.model or default_model
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        blocks = pack(load_texts(args.dataset or default_train, args.text_column), tokenizer, args.seq_len)
        eval_source = args.eval_dataset or (None if args.dataset else default_eval)
        if eval_source:
            eval_blocks = pack(load_texts(eval_source, args.text_column), tokenizer, args.seq_len)
        else:
            blocks, eval_blocks = split_eval(blocks, 0.05, args.seed)

    quantization = None
    if args.load_in_4bit or args.load_in_8bit:
        from transformers import BitsAndBytesConfig

        args.lora = True  # a quantized base does not train: its adapters do
        quantization = (
            BitsAndBytesConfig(load_in_8bit=True)
            if args.load_in_8bit
            else BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16
                if torch.cuda.is_available() and not args.no_bf16
                else torch.float32,
            )
        )
    if args.vanilla:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(accelerator.device)
        log0(accelerator, f"{world} rank(s): plain transformers, each a whole model, under DDP")
        dp_rank, dp_size = rank, world
    else:
        model = hf_rtp.from_pretrained(
            model_path,
            dtype=torch.float32,
            device=accelerator.device,
            rtp_size=args.rtp_size,
            quantization_config=quantization,
        )
        topology = hf_rtp.state_of(model).topology
        log0(
            accelerator,
            f"{topology.world_size} rank(s): {topology.dp_size} replica(s) of a {topology.rtp_size}-rank ring",
        )
        dp_rank, dp_size = topology.dp_rank, topology.dp_size
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        # as in vanilla QLoRA: everything frozen, input gradients on, checkpointing if asked
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = model
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear")
        trained = get_peft_model(model, lora)  # DDP still leaves the rotated base to the ring
    model.train()
    params = [p for p in trained.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    step, samples_seen = 0, 0
    if args.resume_from:
        state = hf_rtp.load_training_state(args.resume_from, trained, optimizer, scheduler)
        step, samples_seen = state["step"], state["samples_seen"]
        log0(
            accelerator,
            f"resumed from {args.resume_from} at step {step} ({state.get('world_size', '?')} -> {world} ranks)",
        )
    ddp = accelerator.prepare(trained)  # DDP averages replicated grads; rotated ones reduce in the ring

    order = GlobalOrder(len(blocks), args.seed)
    # the data-parallel groups: every rank, or with context parallelism every ring (its ranks share a batch)
    group, groups = (dp_rank, dp_size) if args.context_parallel else (rank, world)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available() and not args.no_bf16)
    metrics = os.path.join(args.output_dir, "metrics.jsonl") if rank == 0 else None
    bar = tqdm(total=args.max_steps, initial=step, desc="training", disable=rank != 0)
    while step < args.max_steps:
        started, loss_sum = time.perf_counter(), torch.zeros((), device=accelerator.device)
        for micro in range(args.grad_accum):
            ids = blocks[order.micro_batch(samples_seen, group, groups, args.per_device_batch_size)].to(
                accelerator.device
            )
            samples_seen += groups * args.per_device_batch_size
            batch = {"input_ids": ids, "labels": ids}
            # with --context_parallel each rank holds its chunks of every sequence, and the loss is the sequences'
            split = hf_rtp.context_parallel(model, batch) if args.context_parallel else nullcontext()
            with autocast, ddp.no_sync() if micro < args.grad_accum - 1 and world > 1 else nullcontext(), split:
                loss = ddp(**batch).loss
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach() / args.grad_accum
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)  # global norm, rotated included
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        record = {
            "step": step,
            "loss": mean_over_ranks(loss_sum),
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "tokens_per_s": groups
            * args.grad_accum
            * args.per_device_batch_size
            * args.seq_len
            / (time.perf_counter() - started),
            "peak_mem_gb": max_over_ranks(peak_memory_gb(accelerator.device)),
        }
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            record["eval_loss"] = evaluate(ddp, eval_blocks, rank, world, args, accelerator.device, autocast)
        if metrics:
            with open(metrics, "a") as f:  # a line per step, whole on disk if the run stops after it
                f.write(json.dumps(record) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        if args.save_every and step % args.save_every == 0:
            hf_rtp.save_training_state(
                os.path.join(args.output_dir, f"checkpoint-{step}"),
                trained,
                optimizer,
                scheduler,
                extra={"step": step, "samples_seen": samples_seen, "world_size": world},
            )
    bar.close()
    finish(args, accelerator, model, trained, tokenizer)
    # Release the DDP wrapper and the model before the process groups go, then tear those down
    # ourselves: left to interpreter shutdown, gloo objects can abort the process on exit.
    del ddp, trained, model, optimizer, scheduler
    gc.collect()
    accelerator.end_training()


def finish(args, accelerator, model, trained, tokenizer):
    final = os.path.join(args.output_dir, "final")
    if args.lora:
        if accelerator.is_main_process:  # adapters are replicated: rank 0 has all of them
            trained.save_pretrained(final)
    elif args.vanilla:
        if accelerator.is_main_process:  # every rank holds the same whole model
            model.save_pretrained(final)
    else:
        model.save_pretrained(final)  # collective: rank 0 writes the gathered checkpoint
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        log0(accelerator, f"saved {'LoRA adapters' if args.lora else 'the model'} to {final}")
    if args.push_to_hub and accelerator.is_main_process:
        push(final, args.push_to_hub, accelerator)
    accelerator.wait_for_everyone()


def push(final: str, repo_id: str, accelerator) -> None:
    """Upload the finished folder, as any transformers user would, with huggingface_hub's own client."""
    from huggingface_hub import HfApi

    log0(accelerator, f"pushing to {repo_id}: {', '.join(sorted(os.listdir(final)))}")
    api = HfApi()
    try:
        repo = api.create_repo(repo_id, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo, folder_path=final, commit_message="hf_rtp finetune")
    except Exception as err:
        raise SystemExit(
            f"could not push {final} to the Hub as {repo_id} ({type(err).__name__}: {err}); the checkpoint itself "
            "is complete: upload it later with `hf upload`"
        ) from err


@torch.no_grad()
def evaluate(ddp, eval_blocks, rank, world, args, device, autocast) -> float:
    """Mean loss over the whole eval set, each rank scoring its share."""
    ddp.eval()
    mine = eval_blocks[rank::world]
    total = torch.zeros(2, device=device)  # loss * blocks, blocks
    # every rank runs the same number of batches (rotated ops are collective), padding with a repeat
    batches = math.ceil(math.ceil(len(eval_blocks) / world) / args.per_device_batch_size)
    for b in range(batches):
        ids = mine[b * args.per_device_batch_size : (b + 1) * args.per_device_batch_size]
        real = len(ids)
        if real == 0:
            ids = eval_blocks[:1]
        with autocast:
            loss = ddp(input_ids=ids.to(device), labels=ids.to(device)).loss
        total += torch.stack([loss.float() * real, torch.tensor(float(real), device=device)])
    if world > 1:
        dist.all_reduce(total)
    ddp.train()
    return (total[0] / total[1]).item()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def max_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    if dist.is_initialized():
        t = t.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def log0(accelerator, message: str) -> None:
    if accelerator.is_main_process:
        print(message, flush=True)


if __name__ == "__main__":
    main()
