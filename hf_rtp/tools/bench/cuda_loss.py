"""The fused LM-head loss on one CUDA device, against transformers' own loss: bf16 accuracy, peak
memory (`torch.cuda.max_memory_allocated`) and step time at real vocabularies and sequence lengths.

One GPU holds a ring of one, so the fused math runs exactly as on N ranks minus the transfers (the
head still walks in 16 MB pieces). Multi-rank runs need one GPU per rank (NCCL); this is the check
a single lent GPU allows. Run: `python -m hf_rtp.tools.bench.cuda_loss --out result.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import torch

from ...distributed.transport.ring import Ring
from ...layers import RotatedLinear
from ...model.forward import install_forward

# Llama-3.2-1B's head and width (vocabulary 128256, hidden 2048, tied) on two layers: the head and
# its loss are what this measures; more layers only add the same backbone to both sides.
SHAPE: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)


def _models(dtype, variants=("vanilla", "unfused", "fused")):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=dtype).cuda()
    out = {}
    for name in variants:
        model = ref if name == "vanilla" else copy.deepcopy(ref)
        if name != "vanilla":
            head = model.get_output_embeddings()
            model.set_output_embeddings(RotatedLinear(head, ring=Ring(None), weight=head.weight, bias=head.bias))
            assert install_forward(model, fused=name == "fused") or name == "unfused"
        out[name] = model.train()
    return out


def _batch(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens), generator=g).cuda()
    labels = ids.clone()
    labels[0, : tokens // 4] = -100  # a prompt the loss ignores, as in SFT
    return ids, labels


def _step(model, ids, labels, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach().float()


def accuracy(tokens=2048, autocast=False):
    """Loss and gradients of vanilla bf16 and fused bf16 against a float64 copy of the same model: the
    fused path must be no further from the exact answer than vanilla's own bf16 path."""
    dtype = torch.float32 if autocast else torch.bfloat16
    models = _models(dtype, ("vanilla", "fused"))
    exact = copy.deepcopy(models["vanilla"]).double()
    ids, labels = _batch(tokens, seed=1)
    truth = _step(exact, ids, labels, False).item()
    grads = {n: p.grad for n, p in exact.named_parameters()}
    report = {"tokens": tokens, "weights": str(dtype), "autocast_bf16": autocast, "loss_float64": truth}
    for name, model in models.items():
        loss = _step(model, ids, labels, autocast).item()
        worst = max(
            (p.grad.double() - grads[n]).norm().item() / grads[n].norm().item() for n, p in model.named_parameters()
        )
        report[name] = {"loss": loss, "loss_error": abs(loss - truth), "worst_relative_grad_error": worst}
    del exact, models
    torch.cuda.empty_cache()
    return report


def memory_and_time(tokens, dtype=torch.bfloat16, repeats=5):
    """Peak allocated above the weights during forward+backward, and the median step time."""
    report = {"tokens": tokens, "weights": str(dtype)}
    ids, labels = _batch(tokens)
    for name in ("vanilla", "unfused", "fused"):
        model = _models(dtype, (name,))[name]
        _step(model, ids, labels, False)  # warm-up: kernels, workspaces
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, ids, labels, False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        report[name] = {
            "peak_above_weights_gb": (torch.cuda.max_memory_allocated() - base) / 1e9,
            "step_s": sorted(times)[len(times) // 2],
        }
        del model
        torch.cuda.empty_cache()
    for name in ("vanilla", "unfused"):
        report[f"fused_over_{name}_memory"] = (
            report["fused"]["peak_above_weights_gb"] / report[name]["peak_above_weights_gb"]
        )
        report[f"fused_over_{name}_time"] = report["fused"]["step_s"] / report[name]["step_s"]
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": SHAPE,
        "accuracy": [accuracy(), accuracy(autocast=True)],
        "memory_and_time": [memory_and_time(t) for t in args.tokens],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
