"""Datasets for causal-LM fine-tuning: local json/jsonl/text/parquet files or a Hub name, packed to seq_len."""

from __future__ import annotations

import os

import torch

_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


def load_texts(source: str, text_column: str = "text"):
    """A datasets.Dataset of texts from a local file (by extension) or a Hub dataset name."""
    from datasets import load_dataset

    if os.path.isfile(source):
        builder = _BUILDERS.get(os.path.splitext(source)[1].lower())
        if builder is None:
            raise SystemExit(f"--dataset {source}: use a .json, .jsonl, .txt or .parquet file, or a Hub dataset name")
        data = load_dataset(builder, data_files=source, split="train")
    else:
        data = load_dataset(source, split="train")
    if text_column not in data.column_names:
        raise SystemExit(f"{source} has no '{text_column}' column (it has {data.column_names}); pass --text_column")
    data = data.select_columns([text_column])
    return data if text_column == "text" else data.rename_column(text_column, "text")


def pack(data, tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize every text, append EOS, concatenate, and cut into [n_blocks, seq_len] (the tail is dropped)."""
    ids = tokenizer(list(data["text"]), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = torch.tensor([t for seq in ids for t in seq + eos], dtype=torch.long)
    blocks = len(stream) // seq_len
    if blocks == 0:
        raise SystemExit(f"the dataset holds {len(stream)} tokens, fewer than one --seq_len block of {seq_len}")
    return stream[: blocks * seq_len].view(blocks, seq_len)


def split_eval(blocks: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    n_eval = max(1, int(len(blocks) * fraction))
    return blocks[order[n_eval:]], blocks[order[:n_eval]]


class GlobalOrder:
    """One order of all blocks per epoch, the same whatever the world size.

    Rank r's micro-batch is the r-th slice of the next world_size * batch blocks, so a run resumed
    from `samples_seen` continues at the same place in the data, at any world size.
    """

    def __init__(self, n_blocks: int, seed: int):
        self.n, self.seed, self._perms = n_blocks, seed, {}

    def index(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return int(self._perms[epoch][i])

    def micro_batch(self, samples_seen: int, rank: int, world: int, batch: int) -> list[int]:
        start = samples_seen + rank * batch
        return [self.index(k) for k in range(start, start + batch)]
