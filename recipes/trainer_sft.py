"""The fine-tuning job through transformers.Trainer, on an hf_rtp model.

    accelerate launch --config_file recipes/configs/cpu.yaml recipes/trainer_sft.py
    torchrun --nproc_per_node 2 recipes/trainer_sft.py
    ... recipes/trainer_sft.py --vanilla   # the same run on plain transformers, to compare with

This is plain transformers.Trainer: nothing here is specific to hf_rtp but the loading call.
Trainer wraps the model in DDP (which leaves rotated parameters to the ring) and clips gradients
with torch's clip_grad_norm_ (the global norm over rotated and replicated ones). hf_rtp attaches
to the Trainer that moves its model to a device, so that save_model and the checkpoints that
--save_steps writes are collective, and --resume_from_checkpoint restores every rank's rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from defaults import make_default
from packing import load_texts, pack

import hf_rtp


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--dataset")
    p.add_argument("--output_dir", default="outputs/trainer_sft")
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rtp_size",
        type=int,
        help="ranks per ring (default: all; e.g. GPUs per node for one ring per node, data parallel across nodes)",
    )
    p.add_argument("--save_steps", type=int, default=0, help="write output_dir/checkpoint-N every N steps")
    p.add_argument("--resume_from_checkpoint", help="a checkpoint-N folder this recipe wrote")
    p.add_argument(
        "--vanilla",
        action="store_true",
        help="the same run on plain transformers (every rank a whole model), to compare hf_rtp with",
    )
    args = p.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available() and not dist.is_initialized():
        # Trainer's own waits (its gather of num_items_in_batch at every step, barriers) run on the world group.
        # On the CPU, TrainingArguments does not hand ddp_timeout to accelerate (transformers 5.23), whose group
        # would then wait 30 minutes for a rank that is gone: make the group first, with hf_rtp's timeout.
        dist.init_process_group("gloo", timeout=hf_rtp.collective_timeout())
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        seed=args.seed,
        ddp_find_unused_parameters=False,
        disable_tqdm=False,
        # the same bound for the group accelerate makes on GPUs; the default 30 minutes would outlast hf_rtp's
        ddp_timeout=int(hf_rtp.collective_timeout().total_seconds()),
    )
    with training_args.main_process_first():
        if args.model is None or args.dataset is None:
            default_model, default_train, _ = make_default(os.path.join(args.output_dir, "default"), args.seed)
        model_path = args.model or default_model
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        blocks = pack(load_texts(args.dataset or default_train), tokenizer, args.seq_len)

    if args.vanilla:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        model = hf_rtp.from_pretrained(
            model_path, dtype=torch.float32, device=training_args.device, rtp_size=args.rtp_size
        )
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(blocks), processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)

    # A check worth keeping in the job: DDP must have kept replicated parameters identical.
    replicated = [p for p in model.parameters() if not hasattr(p, "to_local")]
    checksum = torch.stack([p.detach().double().sum() for p in replicated]).sum().reshape(1)
    if dist.is_initialized():
        everyone = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, checksum)
        identical = all(torch.equal(everyone[0], c) for c in everyone)
    else:
        identical = True
    if trainer.is_world_process_zero():
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump({"log": logs, "replicated_identical": identical, "final": final}, f, indent=1)
        print(f"done: loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}; saved {final}", flush=True)
    # Release the DDP wrapper and the model before the process groups go, then tear those down
    # ourselves: left to interpreter shutdown, gloo objects can abort the process on exit.
    accelerator = trainer.accelerator
    del trainer, model
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
