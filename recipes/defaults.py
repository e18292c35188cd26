"""The embedded default: a small Llama, its tokenizer and a dataset, all made deterministically.

Nothing is downloaded. The dataset is a synthetic but learnable corpus (counting and arithmetic
sentences), so the loss visibly falls within a few dozen steps on CPU. About 400 kB in all.
"""

from __future__ import annotations

import json
import os
import random

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
THINGS = ["apples", "stones", "birds", "ships", "lamps", "books", "keys", "coins"]


def sentence(rng: random.Random) -> str:
    a, b = rng.randrange(7), rng.randrange(7)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    if kind == 1:
        thing = rng.choice(THINGS)
        return f"there are {NUMBERS[a + b]} {thing}: {NUMBERS[a]} on the left and {NUMBERS[b]} on the right."
    start = rng.randrange(6)
    return "counting: " + " ".join(NUMBERS[start : start + 6]) + "."


def write_dataset(directory: str, seed: int = 0, train_lines: int = 4000, eval_lines: int = 200) -> tuple[str, str]:
    rng = random.Random(seed)
    paths = []
    for name, lines in (("train.jsonl", train_lines), ("eval.jsonl", eval_lines)):
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            for _ in range(lines):
                f.write(json.dumps({"text": " ".join(sentence(rng) for _ in range(3))}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def write_model(directory: str, train_file: str, seed: int = 0) -> None:
    """A byte-level BPE tokenizer trained on the corpus, and a tiny Llama sized to it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    with open(train_file) as f:
        texts = [json.loads(line)["text"] for line in f]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,  # every width a multiple of 64, bitsandbytes' block: --load_in_4bit quantizes all
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def make_default(directory: str, seed: int = 0) -> tuple[str, str, str]:
    """Create (once) and return (model_dir, train_file, eval_file) under `directory`."""
    model_dir, data_dir = os.path.join(directory, "model"), os.path.join(directory, "data")
    train, evaluation = os.path.join(data_dir, "train.jsonl"), os.path.join(data_dir, "eval.jsonl")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        staging = f"{directory}.tmp-{os.getpid()}"
        os.makedirs(os.path.join(staging, "data"), exist_ok=True)
        train_tmp, _ = write_dataset(os.path.join(staging, "data"), seed)
        write_model(os.path.join(staging, "model"), train_tmp, seed)
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
        if os.path.exists(directory):
            import shutil

            shutil.rmtree(directory)
        os.replace(staging, directory)
    return model_dir, train, evaluation
