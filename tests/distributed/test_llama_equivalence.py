"""A rotated Llama trains exactly like vanilla transformers under DDP, and saves what vanilla saves.

Each rank runs the rotated model on its own batch; in the same process the vanilla model runs on the
whole global batch (the mean of per-rank losses is DDP's objective). World size 3 with a prime
vocabulary and odd widths gives uneven and some empty chunks.

It runs in float64, because Adam divides by sqrt(v) + eps: in float32 a gradient near 1e-8 turns
summation-order noise into a visible step difference. Llama still computes RMSNorm (and its loss)
in float32, so inputs that differ by float64 rounding (chunked matmuls block differently) can round
differently there: the tolerance is float32 rounding, about 100x tighter than a float32 comparison.
"""

import json
import os

import pytest
import torch
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

VARIANTS = [
    pytest.param(tied, shard, id=f"{'tied' if tied else 'untied'}-{'split' if shard else 'single'}")
    for tied in (False, True)
    for shard in (None, "12KB")
]
ATOL, RTOL = 1e-8, 1e-6
LR = 1e-2
# Adam's first step is about lr * sign(grad); where a grad is near eps, float32 noise in it moves
# the step. A real fault (wrong chunk, wrong state) is off by a whole step, so 0.1% of one is strict.
STEP_ATOL = LR * 1e-3
DTYPE = torch.float64


def _rows(param, world, rank):
    from hf_rtp.sharding import chunk_rows

    return slice(*chunk_rows(param.shape[0], world, rank))


def _assert_matches(model, ref, world, rank, what, atol=ATOL):
    """Every parameter (or its grad) equals vanilla's; rotated ones as this rank's rows of it."""
    from torch.distributed.tensor import DTensor

    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        mine = p if what == "param" else p.grad
        theirs = ref_params[name] if what == "param" else ref_params[name].grad
        assert mine is not None and theirs is not None, f"{name}: missing {what}"
        if isinstance(p, DTensor):
            mine, theirs = mine.to_local(), theirs[_rows(p, world, rank)]
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=atol, rtol=RTOL, msg=lambda m: f"{what} of {name}: {m}")


def _next_token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _train_step_and_save(ckpt, out_dir, max_shard_size):
    import hf_rtp
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    assert type(model) is type(ref)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    for name, buf in ref.named_buffers():  # non-persistent rotary frequencies
        torch.testing.assert_close(model.get_buffer(name), buf, atol=0, rtol=0)
    _assert_matches(model, ref, world, rank, "param")
    model.train(), ref.train()

    batches = global_batch(world)
    out = model(input_ids=batches[rank], labels=batches[rank])
    ref_outs = [ref(input_ids=b, labels=b) for b in batches]
    torch.testing.assert_close(out.logits, ref_outs[rank].logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref_outs[rank].loss, atol=1e-6, rtol=1e-6)  # transformers' loss is float32
    # Backward through a float64 loss: vanilla's downcasts logits to float32, whose rounding would
    # then differ between one rank's mean and the reference's mean over ranks.
    _next_token_loss(out.logits, batches[rank]).backward()
    hf_rtp.sync_grads(model)
    torch.stack([_next_token_loss(o.logits, b) for o, b in zip(ref_outs, batches)]).mean().backward()
    _assert_matches(model, ref, world, rank, "grad")

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, atol=ATOL, rtol=RTOL)
    _assert_matches(model, ref, world, rank, "grad")  # clipped alike

    for m in (model, ref):
        torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1).step()
    _assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)

    model.save_pretrained(out_dir, max_shard_size=max_shard_size or "50GB")
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.state_dict().items()}
    if rank == 0:
        vanilla_dir = out_dir + "-vanilla"
        ref.save_pretrained(vanilla_dir, max_shard_size=max_shard_size or "50GB")
        assert sorted(os.listdir(out_dir)) == sorted(os.listdir(vanilla_dir))
        for filename in os.listdir(vanilla_dir):
            if filename.endswith(".safetensors"):
                with safe_open(os.path.join(out_dir, filename), "pt") as a, safe_open(
                    os.path.join(vanilla_dir, filename), "pt"
                ) as b:
                    assert sorted(a.keys()) == sorted(b.keys()), filename
        for filename in ("config.json", "generation_config.json", "model.safetensors.index.json"):
            if os.path.exists(os.path.join(vanilla_dir, filename)):
                with open(os.path.join(out_dir, filename)) as a, open(os.path.join(vanilla_dir, filename)) as b:
                    assert json.load(a) == json.load(b), filename
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=DTYPE)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, full[name]), name
    dist.barrier() if dist.is_initialized() else None
    return out.loss.item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("tied,max_shard_size", VARIANTS)
def test_rotated_llama_matches_vanilla(tmp_path, world_size, tied, max_shard_size):
    ckpt = make_tiny_llama(tmp_path / "ckpt", tied=tied, max_shard_size=max_shard_size or "50GB")
    if max_shard_size:
        assert os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    losses = run_on_ranks(_train_step_and_save, world_size, ckpt, str(tmp_path / "out"), max_shard_size)
    assert len(set(losses)) == world_size  # each rank really trained on its own batch
