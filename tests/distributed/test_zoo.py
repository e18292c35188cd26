"""The model zoo: every family people fine-tune trains, saves and generates exactly like vanilla.

Each family (support/zoo.py: tiny configs with the family's quirks on, checkpoints written by
vanilla save_pretrained) goes through: load, every parameter's rows, loss and logits, every
gradient, an AdamW step, save_pretrained against vanilla's save of the stepped model (names and
tensors), greedy generate on each rank's own prompts, and a bf16 checkpoint loaded with
dtype="auto". All families at 2 ranks, a subset at 3 (uneven expert groups, empty chunks).

One spawn per world size runs every family in turn (a process start costs more than a family's
checks); each family's outcome comes back on its own and is reported as its own test.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from support.compare import (
    DTYPE,
    GRAD_ATOL,
    GRAD_RTOL,
    LR,
    STEP_ATOL,
    assert_matches,
    assert_same_model,
    forward_both,
)
from support.models import global_batch
from support.spawn import run_on_ranks
from support.zoo import AT_THREE, AUTO, ZOO, make_zoo_checkpoint

# The zoo trains through transformers' float32 loss math (the fused loss, against vanilla's own loss), so
# gradients carry float32 rounding of another summation order (~1e-9 here). Adam with eps 1e-6 would
# turn that into 1e-5 of a step on tiny gradients; with 1e-4 it moves a step by ~1e-7, while a wrong
# chunk or a missing term is still off by a whole step.
ZOO_ADAM_EPS = 1e-4
BF16_ATOL = 3e-2  # bf16 rounding of tiny logits; a wrong chunk or a missing scale is off by far more


def _load_pair(ckpt, dtype, name):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    # eager attention and experts: float64 everywhere (grouped_mm has no float64 kernel), same math
    extra = dict(attn_implementation="eager")
    if "expert" in Path(os.path.join(ckpt, "config.json")).read_text():
        extra["experts_implementation"] = "eager"
    model = hf_rtp.from_pretrained(ckpt, dtype=dtype, plan="auto" if name in AUTO else None, **extra)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **extra)
    return model, ref


def _check_family(name, ckpt, bf16_ckpt, out_dir, rank, world):
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    import hf_rtp

    model, ref = _load_pair(ckpt, DTYPE, name)
    assert_same_model(model, ref, world, rank)
    assert any(isinstance(p, DTensor) for p in model.parameters()) == (world > 1)

    model.train(), ref.train()
    batches = global_batch(world)
    with torch.no_grad():
        forward_both(model, ref, batches, rank)  # logits, loss and aux loss from full logits
    # what training runs: the fused LM-head loss (logits None), against vanilla's own loss
    out = model(input_ids=batches[rank], labels=batches[rank])
    assert (out.logits is None) == (world > 1), "the fused loss did not run" if world > 1 else "logits missing"
    ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
    torch.testing.assert_close(out.loss, ref_losses[rank], atol=1e-6, rtol=1e-6)
    out.loss.backward()
    hf_rtp.sync_grads(model)
    torch.stack(ref_losses).mean().backward()
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for m in (model, ref):
        torch.optim.AdamW(m.parameters(), lr=LR, eps=ZOO_ADAM_EPS, weight_decay=0.1).step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)

    model.save_pretrained(out_dir)
    if rank == 0:
        ref.save_pretrained(out_dir + "-vanilla")
        ours, theirs = load_file(f"{out_dir}/model.safetensors"), load_file(f"{out_dir}-vanilla/model.safetensors")
        assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
        for key, tensor in theirs.items():
            torch.testing.assert_close(
                ours[key], tensor, atol=STEP_ATOL, rtol=0, msg=lambda m, key=key: f"saved {key}: {m}"
            )

    model.eval(), ref.eval()
    prompts = global_batch(world, batch=2, seq=4 + rank, seed=7)[rank]
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
        expected = ref.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
    assert torch.equal(generated, expected), f"generate: {generated.tolist()} != {expected.tolist()}"
    del model, ref

    model, ref = _load_pair(bf16_ckpt, "auto", name)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    # every parameter in vanilla's dtype: bfloat16, but where the class keeps one in float32 (DeepSeek-V3's router,
    # _keep_in_fp32_modules_strict in transformers 5.24)
    assert dtypes == {n: p.dtype for n, p in ref.named_parameters()} and torch.bfloat16 in dtypes.values()
    assert_matches(model, ref, world, rank, "param", atol=0)
    with torch.no_grad():
        logits, expected = model(input_ids=batches[rank]).logits, ref(input_ids=batches[rank]).logits
    torch.testing.assert_close(logits.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)
    return out.loss.item()


def _run_zoo(root, names):
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    outcomes = {}
    for name in names:
        try:
            ckpt, bf16 = f"{root}/{name}", f"{root}/{name}-bf16"
            outcomes[name] = ("ok", _check_family(name, ckpt, bf16, f"{root}/out-{world}-{name}", rank, world))
        except Exception:
            outcomes[name] = ("failed", traceback.format_exc())
        if dist.is_initialized():
            dist.barrier()  # a family that failed on one rank only must not shift the next one
    return outcomes


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    for name in ZOO:
        make_zoo_checkpoint(name, root / name)
        make_zoo_checkpoint(name, root / f"{name}-bf16", dtype=torch.bfloat16)
    return str(root)


@pytest.fixture(scope="module")
def at_two(zoo_root):
    return run_on_ranks(_run_zoo, 2, zoo_root, list(ZOO), timeout=900)


@pytest.fixture(scope="module")
def at_three(zoo_root):
    return run_on_ranks(_run_zoo, 3, zoo_root, list(AT_THREE), timeout=900)


def _assert_family(outcomes, name):
    for rank, per_rank in enumerate(outcomes):
        status, detail = per_rank[name]
        assert status == "ok", f"rank {rank}:\n{detail}"
    losses = [per_rank[name][1] for per_rank in outcomes]
    assert len(set(losses)) == len(losses)  # each rank really trained on its own batch


@pytest.mark.parametrize("name", list(ZOO))
def test_family_matches_vanilla_at_two_ranks(at_two, name):
    _assert_family(at_two, name)


@pytest.mark.parametrize("name", AT_THREE)
def test_family_matches_vanilla_at_three_ranks(at_three, name):
    _assert_family(at_three, name)
