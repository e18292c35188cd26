"""Tiny checkpoints made locally with vanilla transformers (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config

VOCAB = 101  # prime: no world size divides it, so vocabulary chunks are uneven
_SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4)


def tiny_llama_config(tied: bool = False, **overrides) -> LlamaConfig:
    settings = dict(_SHARED, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaConfig(**{**settings, **overrides})  # num_key_value_heads=2: grouped-query attention


def tiny_config(arch: str, tied: bool = False, **overrides):
    if arch == "llama":
        return tiny_llama_config(tied, **overrides)
    if arch == "gpt2":  # GPT-2 always ties wte and lm_head; dropout off so train() is deterministic
        settings = dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2Config(**{**settings, **overrides})
    if arch == "mixtral":  # 5 experts: uneven expert groups at 2 and 3 ranks
        settings = dict(
            _SHARED,
            intermediate_size=24,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            output_router_logits=True,
            tie_word_embeddings=tied,
        )
        return MixtralConfig(**{**settings, **overrides})
    if arch == "qwen2":  # q/k/v carry biases; tests load it with plan="auto" or a plan of their own
        settings = dict(_SHARED, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
        return Qwen2Config(**{**settings, **overrides})
    raise ValueError(arch)


def make_tiny(arch: str, path, tied: bool = False, max_shard_size: str = "50GB", seed: int = 0, **overrides) -> str:
    """Save a randomly initialised tiny model (several files when max_shard_size is small)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tied, **overrides), dtype=torch.float32)
    with torch.no_grad():  # some inits leave zeros (biases, norms): make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


def make_tiny_llama(path, tied: bool = False, max_shard_size: str = "50GB", seed: int = 0, **overrides) -> str:
    return make_tiny("llama", path, tied, max_shard_size, seed, **overrides)


def rewrite_names(path: str, rename) -> None:
    """Rewrite a single-file checkpoint's tensor names (e.g. to the original GPT-2 layout)."""
    file = os.path.join(path, "model.safetensors")
    save_file({rename(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})


def make_fused_mixtral(path) -> str:
    """A Mixtral checkpoint stored as transformers 5 holds it: fused experts, not per-expert tensors."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), dtype=torch.float32)
    model.save_pretrained(path, save_original_format=False)
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in header), "expected fused expert names"
    return str(path)


def stored_names(path: str) -> set[str]:
    names = set()
    for filename in os.listdir(path):
        if filename.endswith(".safetensors"):
            names |= set(load_file(os.path.join(path, filename)))
    return names


def global_batch(world_size: int, batch: int = 2, seq: int = 9, seed: int = 1) -> torch.Tensor:
    """[world_size, batch, seq] token ids: rank r trains on [r], the vanilla reference on all of them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (world_size, batch, seq), generator=gen)


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB ids ('t0' .. 't100'), for trainers that want one (TRL)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word, pad_token="t0", eos_token="t1", unk_token="t2")


def fake_hub_cache(root, repo, commits):
    """A huggingface_hub cache holding `commits` ({hash: checkpoint folder}) of `repo`, refs/main -> the last."""
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    for commit, folder in commits.items():
        shutil.copytree(folder, os.path.join(base, "snapshots", commit))
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(list(commits)[-1])
    return root


def trained_one_step(ckpt, lr: float = 1e-2):
    """hf_rtp's model (float32, train mode) after one AdamW step on this rank's batch of global_batch:
    (model, optimizer). Works in a spawned rank and in a single process alike."""
    import hf_rtp

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = global_batch(world)[rank]
    model(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)
    optimizer.step()
    return model, optimizer
