"""Rotated models train exactly like vanilla transformers under DDP, and save what vanilla saves.

Llama, GPT-2 and Mixtral through their registered plans; Qwen2 through plan="auto". Every other
family, and these at their plainest, are in test_zoo.py.

Each rank runs the rotated model on its own batch; in the same process the vanilla model runs on the
whole global batch (the mean of per-rank losses is DDP's objective). World size 3 with a prime
vocabulary and odd widths gives uneven and some empty chunks.

It runs in float64 (support/compare.py says why and what the tolerances are).
"""

import json
import os

import pytest
import torch
from support.compare import (
    ADAM_EPS,
    ATOL,
    DTYPE,
    LR,
    RTOL,
    STEP_ATOL,
    assert_matches,
    assert_same_model,
    backward_both,
)
from support.models import global_batch, make_fused_mixtral, make_tiny, rewrite_names, stored_names
from support.spawn import run_on_ranks

SPLIT = "12KB"  # small enough to cut every tiny checkpoint into several files
CASES = [
    *[
        pytest.param(
            "llama",
            tied,
            shard,
            None,
            world,
            id=f"llama-{'tied' if tied else 'untied'}-{'split' if shard else 'single'}-{world}",
        )
        for tied in (False, True)
        for shard in (None, SPLIT)
        for world in (1, 2, 3)
    ],
    *[
        pytest.param(arch, False, shard, None, world, id=f"{arch}-{'split' if shard else 'single'}-{world}")
        for arch in ("gpt2", "mixtral")
        for shard in (None, SPLIT)
        for world in (1, 2, 3)
    ],
    pytest.param("gpt2", False, None, "original-names", 3, id="gpt2-original-hub-names-3"),
    pytest.param("mixtral", False, None, "fused", 3, id="mixtral-fused-experts-3"),
    # Chunks walk the ring in pieces of at most 1 KB (a few rows; some pieces empty at 3 ranks)
    pytest.param("llama", True, SPLIT, "pieces", 3, id="llama-tied-split-pieces-3"),
    pytest.param("gpt2", False, None, "pieces", 3, id="gpt2-pieces-3"),
    pytest.param("mixtral", False, None, "pieces", 2, id="mixtral-pieces-2"),
    pytest.param("qwen2", True, SPLIT, "auto", 2, id="qwen2-auto-tied-split-2"),
]
# test_zoo.py runs these exact cases (one file, untied where the family allows, 2 and 3 ranks) with
# greedy generate and bf16 besides; here stay the tied, split, world-1 and stored-format variants
IN_THE_ZOO = {"llama-untied-single-2", "llama-untied-single-3", "gpt2-single-2", "gpt2-single-3", "mixtral-single-2"}
# At 3 ranks one file is the zoo's case and split files are the harder load (uneven chunks across
# files): kept for gpt2, mixtral and tied llama (also in pieces); dropped where a kept case covers it
COVERED_AT_THREE = {"llama-tied-single-3", "mixtral-single-3", "llama-untied-split-3"}
CASES = [case for case in CASES if case.id not in IN_THE_ZOO | COVERED_AT_THREE]


def _train_step_and_save(ckpt, out_dir, max_shard_size, plan, like_vanilla_save, piece_size):
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # transformers' default grouped_mm experts have no float64 kernel; eager is the same math
    with open(os.path.join(ckpt, "config.json")) as f:
        extra = {"experts_implementation": "eager"} if json.load(f)["model_type"] == "mixtral" else {}
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, plan=plan, rotation_piece_size=piece_size, **extra)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE, **extra)
    assert_same_model(model, ref, world, rank)
    model.train(), ref.train()

    batches = global_batch(world)
    out, _ = backward_both(model, ref, batches, rank)
    assert_matches(model, ref, world, rank, "grad")

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, atol=ATOL, rtol=RTOL)
    assert_matches(model, ref, world, rank, "grad")  # clipped alike

    for m in (model, ref):
        torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1).step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)

    model.save_pretrained(out_dir, max_shard_size=max_shard_size or "50GB")
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.state_dict().items()}
    vanilla_dir = out_dir + "-vanilla"
    if rank == 0:
        ref.save_pretrained(vanilla_dir, max_shard_size=max_shard_size or "50GB")
        # the names vanilla writes: the checkpoint's own (per-expert Mixtral stays per-expert, fused
        # stays fused), with the model's prefix where the checkpoint lacked it (GPT-2's original files)
        assert stored_names(out_dir) == stored_names(vanilla_dir)
    if rank == 0 and like_vanilla_save:
        assert sorted(os.listdir(out_dir)) == sorted(os.listdir(vanilla_dir))
        for filename in os.listdir(vanilla_dir):
            if filename.endswith(".safetensors"):
                with (
                    safe_open(os.path.join(out_dir, filename), "pt") as a,
                    safe_open(os.path.join(vanilla_dir, filename), "pt") as b,
                ):
                    assert sorted(a.keys()) == sorted(b.keys()), filename
        for filename in ("config.json", "generation_config.json", "model.safetensors.index.json"):
            if os.path.exists(os.path.join(vanilla_dir, filename)):
                with open(os.path.join(out_dir, filename)) as a, open(os.path.join(vanilla_dir, filename)) as b:
                    assert json.load(a) == json.load(b), filename
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=DTYPE, **extra)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, full[name]), name
    dist.barrier() if dist.is_initialized() else None
    return out.loss.item()


@pytest.mark.parametrize("arch,tied,max_shard_size,special,world_size", CASES)
def test_rotated_model_matches_vanilla(tmp_path, arch, tied, max_shard_size, special, world_size):
    if special == "fused":
        ckpt = make_fused_mixtral(tmp_path / "ckpt")
    else:
        ckpt = make_tiny(arch, tmp_path / "ckpt", tied=tied, max_shard_size=max_shard_size or "50GB")
    if special == "original-names":  # as openai-community/gpt2 stores it: no "transformer." prefix
        rewrite_names(ckpt, lambda name: name.removeprefix("transformer."))
    if max_shard_size:
        assert os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    plan = "auto" if special == "auto" else None
    # Vanilla groups a split Mixtral's per-expert tensors into files by shared storage; ours split in
    # sorted name order. Both hold the same names and load alike: file-by-file equality is not asked.
    like_vanilla_save = special in (None, "auto", "pieces") and not (arch == "mixtral" and max_shard_size)
    piece_size = "1KB" if special == "pieces" else "16MB"
    args = (ckpt, str(tmp_path / "out"), max_shard_size, plan, like_vanilla_save, piece_size)
    losses = run_on_ranks(_train_step_and_save, world_size, *args)
    assert len(set(losses)) == world_size  # each rank really trained on its own batch
