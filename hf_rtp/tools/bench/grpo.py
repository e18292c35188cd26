"""`hf-rtp bench --grpo`: the time of one GRPOTrainer step, vanilla DDP beside hf_rtp, generation in-process.

A step of online RL is mostly `generate`: each rank samples `--num-generations` completions of
`--new-tokens` for its prompts of `--seq` tokens, scores them (a reward function of the completion's
length, no reward model) and trains on them. Each rank runs TRL's GRPOTrainer as its users do: the
vanilla model (Trainer wraps it in DDP) or hf_rtp's (rotated). The step time is the median of the steps
after the first (the slowest rank's, from the trainer's own step callbacks); the tokens are random ids
spelled as words of a word-level tokenizer over the checkpoint's vocabulary. Writes grpo.json to --output.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from .processes import run_ranks

STRATEGIES = ("ddp", "rtp")


def measure(strategy: str, checkpoint: str, world_size: int, args) -> dict:
    worker_args = [
        strategy,
        checkpoint,
        str(args.seq),
        str(args.new_tokens),
        str(args.num_generations),
        str(args.steps),
    ]
    reports = run_ranks("hf_rtp.tools.bench.grpo", worker_args, world_size, threads=args.threads, timeout=args.timeout)
    steps = [max(times) for times in zip(*(r["step_times"] for r in reports), strict=True)][1:]
    return {
        "strategy": strategy,
        "world_size": world_size,
        "step_s": statistics.median(steps),
        "step_times": steps,
        "rewards": [r["rewards"] for r in reports],
    }


def run(args, checkpoint: str, sizes: list[int], strategies: list[str], name: str) -> dict:
    rows = []
    for n in sizes:
        for strategy in [s for s in strategies if s in STRATEGIES]:
            print(f"GRPO steps with {strategy} on {n} rank(s) ...", flush=True)
            rows.append(measure(strategy, checkpoint, n, args))
    title = (
        f"{name}: GRPOTrainer step, prompts of {args.seq} tokens, {args.num_generations} generations of "
        f"{args.new_tokens} per prompt, per rank, cpu"
    )
    lines = [f"{'strategy':<9} {'N':>2} {'step s':>8}"] + [
        f"{r['strategy']:<9} {r['world_size']:>2} {r['step_s']:>8.2f}" for r in rows
    ]
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    ratios = [
        f"N={n}: rtp/ddp step time {by['rtp', n]['step_s'] / by['ddp', n]['step_s']:.2f}x"
        for n in sizes
        if ("rtp", n) in by and ("ddp", n) in by
    ]
    print(f"\n{title}\n" + "\n".join(lines) + "\n" + "\n".join(ratios))
    result = {"settings": vars(args), "checkpoint": checkpoint, "grpo": rows}
    with open(os.path.join(args.output, "grpo.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {os.path.join(args.output, 'grpo.json')}")
    return result


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t2")


def main(argv: list[str]) -> None:
    """One rank: GRPOTrainer for `steps` steps; prints its step times as one JSON line."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    strategy, checkpoint, seq, new_tokens, generations, steps = argv[0], argv[1], *map(int, argv[2:])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    draw = torch.Generator().manual_seed(rank)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, vocab, (seq,), generator=draw)) for _ in range(world)]
    if strategy == "rtp":
        import hf_rtp

        model = hf_rtp.from_pretrained(checkpoint, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            times.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            times[-1] = time.perf_counter() - times[-1]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="hf-rtp-grpo-"),
        max_steps=steps,
        per_device_train_batch_size=generations,  # one prompt per rank per step, `generations` completions of it
        num_generations=generations,
        max_completion_length=new_tokens,
        learning_rate=1e-6,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * steps]),
        processing_class=_tokenizer(vocab),
        callbacks=[Clock()],
    )
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    print(json.dumps({"rank": rank, "step_times": times, "rewards": rewards}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
