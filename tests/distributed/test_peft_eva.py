"""PEFT's EVA initialisation (`initialize_lora_eva_weights`), which runs forwards until every layer's SVD of its
inputs converges, on a rotated model against vanilla PEFT in the same processes (so vanilla too sees
torch.distributed initialised, as under DDP). By default PEFT gathers every rank's layer inputs: the adapters
equal vanilla's with each rank on its own batches. With `gather_distributed_inputs=False` each rank converges on its
own batches: the same batches on every rank equal vanilla's; different ones were ranks falling out of step (a
rotated forward is collective), failing after the entry timeout without naming EVA, and are now refused on every
rank at the first forward."""

import os
import time
import warnings

import pytest
import torch
from support.models import make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _batches(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _eva(model, data, gather, seed=0):
    from peft import EvaConfig, LoraConfig, get_peft_model, initialize_lora_eva_weights

    config = LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="eva", eva_config=EvaConfig(rho=2.0, tau=0.99))
    torch.manual_seed(seed)  # LoRA's random init before EVA writes its components: another for each model
    adapted = get_peft_model(model, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own warning about gathering the same inputs from every rank
        initialize_lora_eva_weights(adapted, data, gather_distributed_inputs=gather, show_progress_bar=False)
    weights = {}
    for name, p in adapted.named_parameters():
        if "lora_A" in name:
            weights[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return weights, dict(adapted.peft_config["default"].rank_pattern)


def _gap(ours, theirs):
    assert ours[0].keys() == theirs[0].keys() and ours[1] == theirs[1]
    return max(float((ours[0][n] - theirs[0][n]).abs().max()) for n in ours[0])


def _compare(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    own, same = _batches(10 + rank), _batches(1)
    out = {}
    for name, data, gather in (("gathered, own batches", own, True), ("not gathered, same batches", same, False)):
        ours = _eva(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), data, gather, seed=1)
        theirs = _eva(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), data, gather, seed=2)
        out[name] = _gap(ours, theirs)  # 0 only where EVA wrote every A: the random inits differ
    began = time.monotonic()
    with pytest.raises(hf_rtp.RotatedStateError) as refused:
        _eva(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), own, False)
    out["refused"] = (str(refused.value), time.monotonic() - began)
    return out


def test_eva_adapters_equal_vanillas_and_ungathered_different_batches_are_refused(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for out in run_on_ranks(_compare, 2, str(ckpt), timeout=300):
        for name in ("gathered, own batches", "not gathered, same batches"):
            assert out[name] == 0.0, name
        said, seconds = out["refused"]
        assert "gather_distributed_inputs=False" in said and "different batches" in said
        assert seconds < 30  # at the first forward, not after the 60 s entry timeout
