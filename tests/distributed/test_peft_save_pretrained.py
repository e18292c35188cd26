"""A PeftModel's own `model.save_pretrained(dir)`, called on every rank, over a model hf_rtp loaded at 2 ranks, where
what PEFT writes holds rotated tensors: the trainable copy `modules_to_save=["lm_head"]` makes of the rotated head,
and the rotated embeddings `save_embedding_layers=True` writes (of a tied checkpoint: one tensor under two names).

It was refused ("save with model.save_pretrained(dir) on every rank", what the user had done) after every rank had
written README.md. Now every rank gathers those tensors and one writes: the folder equals what vanilla PEFT writes for
vanilla transformers trained alike in the same processes (file names, tensor names, shapes and dtypes, values within
the gradient tolerance in float64, adapter_config.json), each file written once, and it loads onto a vanilla base as
vanilla's adapter does. `is_main_process=False` on every rank writes nothing, as in vanilla; a call on one rank alone
is named on it within the entry timeout, nothing written.
"""

import json
import os

import torch
from support.compare import GRAD_ATOL
from support.models import VOCAB, global_batch, make_tiny
from support.spawn import run_on_ranks

ENTRY = {"HF_RTP_ENTRY_TIMEOUT": "5"}
CASES = {
    "modules_to_save": (False, dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]), {}),
    "embedding_layers": (True, dict(target_modules=["q_proj"]), dict(save_embedding_layers=True)),
}


def _adapt(model, config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # init_lora_weights=False: random B too, so every adapter gets a gradient
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **config))


def _counted(owner, name, counts):
    """`owner.name` counting its calls on this rank into `counts[name]`."""
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(owner, name, counting)


def _contents(folder):
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    return sorted(os.listdir(folder)), tensors, config


def _save_on_every_rank(ckpts, world, out):
    import peft.peft_model
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    batch = global_batch(world, seq=12)
    results, models = {}, {}
    for case, (tied, config, keywords) in CASES.items():
        ckpt = ckpts[tied]
        vanilla = _adapt(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), config)
        model = models[case] = _adapt(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), config)
        vanilla(input_ids=batch.flatten(0, 1), labels=batch.flatten(0, 1)).loss.backward()
        model.train()(input_ids=batch[rank], labels=batch[rank]).loss.backward()
        hf_rtp.sync_grads(model)
        for m in (model, vanilla):
            torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5).step()

        counts: dict[str, int] = {}
        _counted(peft.peft_model, "safe_save_file", counts)  # PEFT's own write of the adapter file
        _counted(PeftModel, "create_or_update_model_card", counts)  # its README.md
        saved = os.path.join(out, case, "rtp")
        model.save_pretrained(saved, **keywords)  # on every rank, as the refusal said and the user did
        written = dict(counts)
        counts.clear()
        model.save_pretrained(os.path.join(out, case, "nobody"), is_main_process=False, **keywords)
        nobody = dict(counts)
        if rank == 0:
            vanilla.save_pretrained(os.path.join(out, case, "vanilla"), **keywords)
        dist.barrier()
        files, tensors, adapter_config = _contents(saved)
        vanilla_files, expected, vanilla_config = _contents(os.path.join(out, case, "vanilla"))
        differences = {
            name: (tuple(t.shape), t.dtype == expected[name].dtype, (t - expected[name]).abs().max().item())
            for name, t in tensors.items()
            if name in expected
        }
        base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
        loaded = dict(PeftModel.from_pretrained(base, saved).named_parameters())
        after = {n: (loaded[n] - p).abs().max().item() for n, p in vanilla.named_parameters() if p.requires_grad}
        results[case] = dict(
            files=(files, vanilla_files),
            names=(sorted(tensors), sorted(expected)),
            shapes={n: (tuple(t.shape), tuple(expected[n].shape)) for n, t in tensors.items() if n in expected},
            differences=differences,
            configs=(adapter_config, vanilla_config),
            written=written,
            nobody=(nobody, sorted(os.listdir(os.path.join(out, case, "nobody")))),
            after=after,
        )

    # one rank alone: named within the entry timeout, before anything is written; the other waits at a barrier
    alone = os.path.join(out, "alone")
    if rank == 0:
        try:
            models["modules_to_save"].save_pretrained(alone)
            results["alone"] = "saved"
        except hf_rtp.CollectiveMisuseError as refused:
            results["alone"] = str(refused)
    dist.barrier()
    results["alone written"] = os.path.exists(alone) and sorted(os.listdir(alone))
    return results


def test_peft_save_pretrained_on_every_rank_writes_what_vanilla_peft_writes_once(tmp_path):
    ckpts = {False: make_tiny("llama", tmp_path / "untied"), True: make_tiny("llama", tmp_path / "tied", tied=True)}
    ranks = run_on_ranks(_save_on_every_rank, 2, ckpts, 2, str(tmp_path / "out"), env=ENTRY)
    for rank, results in enumerate(ranks):
        for case, expected_name in (("modules_to_save", "base_model.model.lm_head.weight"), ("embedding_layers", None)):
            found = results[case]
            files, vanilla_files = found["files"]
            assert files == vanilla_files == ["README.md", "adapter_config.json", "adapter_model.safetensors"], case
            names, vanilla_names = found["names"]
            assert names == vanilla_names, (case, names, vanilla_names)
            if expected_name is not None:  # the trained copy of the head, whole (vanilla's shape), not a rank's rows
                assert found["shapes"][expected_name] == ((VOCAB, 32), (VOCAB, 32)), found["shapes"]
            else:  # the embeddings PEFT saves with save_embedding_layers=True
                assert any("embed_tokens" in n for n in names), names
            for name, (shape, same_dtype, difference) in found["differences"].items():
                assert same_dtype and difference <= GRAD_ATOL, (case, name, shape, difference)
            assert found["configs"][0] == found["configs"][1], case
            # written once, by rank 0; nothing at all with is_main_process=False on every rank
            once = {"safe_save_file": 1, "create_or_update_model_card": 1} if rank == 0 else {}
            assert found["written"] == once, (rank, case, found["written"])
            assert found["nobody"] == ({}, []), (rank, case)
            assert found["after"] and max(found["after"].values()) <= GRAD_ATOL, (case, found["after"])
    alone = ranks[0]["alone"]
    assert "PeftModel.save_pretrained is collective: every rank must call it" in alone, alone
    assert ranks[0]["alone written"] is False and ranks[1]["alone written"] is False
