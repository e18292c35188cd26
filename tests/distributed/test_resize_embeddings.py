"""`model.resize_token_embeddings` on a rotated model, as a chat fine-tune calls it after adding tokens.

Beside vanilla in the same processes, seeded alike: the resized embedding and head equal vanilla's
(both `mean_resizing` modes, `pad_to_multiple_of`, tied and untied heads, sizes no ring size divides),
re-cut over the ring, on one ring of 2 and on 2 replicas of 2-rank rings whose writer is not rank 0; then one SGD
step on batches that use the new tokens gives vanilla's gradients
under DDP, and the saved checkpoint loads in vanilla with vanilla's weights.
"""

import os

import pytest
import torch
from support.compare import GRAD_ATOL
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks

CASES = [  # (tied, new_num_tokens, pad_to_multiple_of, mean_resizing)
    (False, VOCAB + 6, None, True),
    (False, VOCAB + 3, 8, False),
    (True, VOCAB + 5, None, True),
    (True, VOCAB - 4, None, True),  # shrinking keeps the first rows
]


def _resize_train_save(ckpts, layout, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    extra = {}
    if (
        layout == "2x2-mesh"
    ):  # 2 replicas of 2-rank rings, laid out so that the writer (ring rank 0 of replica 0) is rank 1
        dist.init_process_group("gloo")
        extra["device_mesh"] = DeviceMesh("cpu", [[1, 0], [3, 2]], mesh_dim_names=("dp", "rtp"))
    results = []
    for case, (tied, new, pad, mean_resizing) in enumerate(CASES):
        ckpt = ckpts[tied]
        vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
        torch.manual_seed(case)
        vanilla.resize_token_embeddings(new, pad_to_multiple_of=pad, mean_resizing=mean_resizing)
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, **extra)
        torch.manual_seed(case)  # the writer draws the new rows, as vanilla did
        returned = model.resize_token_embeddings(new, pad_to_multiple_of=pad, mean_resizing=mean_resizing)
        size = vanilla.config.vocab_size
        assert returned is model.get_input_embeddings() and returned.num_embeddings == size == model.config.vocab_size
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        with torch.no_grad():
            same = {
                n: torch.equal(p.full_tensor(), vanilla.get_parameter(n))
                for n, p in model.named_parameters()
                if hasattr(p, "full_tensor")
            }
        # a step on batches that use the new tokens (every rank its own), against vanilla on all of them
        batch = torch.randint(0, size, (world, 2, 9), generator=torch.Generator().manual_seed(7))
        vanilla.train()(input_ids=batch.flatten(0, 1), labels=batch.flatten(0, 1)).loss.backward()
        model.train()(input_ids=batch[rank], labels=batch[rank]).loss.backward()
        hf_rtp.sync_grads(model)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = (grad - vanilla.get_parameter(name).grad).abs().max().item()
        for m in (model, vanilla):
            torch.optim.SGD(m.parameters(), lr=0.5).step()
        model.save_pretrained(os.path.join(out, str(case)))
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, str(case)), dtype=torch.float64)
        saved = {n: (p - vanilla.get_parameter(n)).abs().max().item() for n, p in reloaded.named_parameters()}
        results.append((size, same, grads, saved, reloaded.config.vocab_size))
    return results


@pytest.mark.parametrize("layout", ["2", "3", "2x2-mesh"])  # 3: uneven rows, old and new
def test_resize_equals_vanilla_and_trains_saves_and_reloads(tmp_path, layout):
    ckpts = {tied: make_tiny("llama", tmp_path / f"ckpt-{tied}", tied=tied) for tied in (False, True)}
    world = 4 if "x" in layout else int(layout)
    per_rank = run_on_ranks(_resize_train_save, world, ckpts, layout, str(tmp_path / "out"))
    for (_tied, new, pad, _), results in zip(CASES, zip(*per_rank, strict=True), strict=True):
        for size, same, grads, saved, reloaded_size in results:
            assert size == (new if pad is None else -(-new // pad) * pad) and reloaded_size == size
            assert same and all(same.values()), same  # rotated embedding and head: vanilla's values, bit for bit
            # float64 model; the fused loss's float32 island rounds differently from vanilla's (support/compare.py)
            assert max(grads.values()) < GRAD_ATOL, grads
            assert max(saved.values()) < GRAD_ATOL, saved


def _draws_after_writer_steps(ckpt):
    """What a DDP rank's generator gives after the call, and a LoRA made after a resize, beside vanilla."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import hf_rtp

    rank = int(os.environ["RANK"])
    seen = {}
    # each rank seeds its own generator differently: vanilla's draws after the call are then its own
    for step in ("resize", "resize without mean_resizing", "head"):
        draws = []
        for load in (AutoModelForCausalLM.from_pretrained, hf_rtp.from_pretrained):
            torch.manual_seed(100 + rank)
            if step.startswith("resize"):  # the covariance draw, or the init's normal over the new rows
                load(ckpt, dtype=torch.float32).resize_token_embeddings(VOCAB + 6, mean_resizing="without" not in step)
            else:  # a classifier head the causal LM checkpoint lacks: initialised as vanilla does
                kwargs = {"auto_class": AutoModelForSequenceClassification} if load is hf_rtp.from_pretrained else {}
                (load if kwargs else AutoModelForSequenceClassification.from_pretrained)(ckpt, num_labels=2, **kwargs)
            draws.append(torch.rand(4).tolist())
        seen[step] = draws
    # one seed on every rank: a LoRA made after a resize is the same on every rank, and vanilla's
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=True)
    adapters = []
    for load in (AutoModelForCausalLM.from_pretrained, hf_rtp.from_pretrained):
        model = load(ckpt, dtype=torch.float32)
        torch.manual_seed(5)
        model.resize_token_embeddings(VOCAB + 6)
        lora = get_peft_model(model, config)
        adapters.append({n: p.detach().tolist() for n, p in lora.named_parameters() if "lora_A" in n})
    seen["lora"] = adapters
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_every_ranks_random_state_after_a_resize_or_a_head_init_is_a_ddp_ranks(tmp_path, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    per_rank = run_on_ranks(_draws_after_writer_steps, world, ckpt)
    for rank, seen in enumerate(per_rank):
        for step in ("resize", "resize without mean_resizing", "head"):
            vanilla, ours = seen[step]
            assert ours == vanilla, (rank, step)
        vanilla, ours = seen["lora"]
        assert ours and ours == vanilla, rank
        assert ours == per_rank[0]["lora"][1], rank  # the same on every rank
