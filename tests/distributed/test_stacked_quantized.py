"""Quantized q/k/v and gate/up walk as one (layers/siblings.py, layers/linear4bit.py and linear8bit.py's `walk_rows`):
their packed rows stacked, one hop and one bitsandbytes matmul per chunk, beside vanilla transformers + bitsandbytes
+ PEFT under DDP on the same weights.

Each case trains two steps with LoRA on every stacked member and PEFT's bias="all" (Qwen2's q/k/v biases, whole and
replicated on a quantized base, then train): in the first every linear walks alone (its group taken away), in the
second they walk stacked. Every trainable gradient is vanilla's after each; the second step makes fewer exchanges by
the hops the stacked walks save, and what autograd saves for backward holds no stacked copy of the packed rows, only
each member's own piece. A decode step's forward (rotation_moves="activations": its tokens move) walks each quantized
member alone, the same walks as with no groups, and greedy decoding gives vanilla's tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.compare import trainable_grad_gaps, vanilla_training_path
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("bitsandbytes")

WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # whole 64-value blocks, as 4-bit needs
TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
CASES = {"qwen2-4bit-2": ("qwen2", 4, 2), "llama-8bit-3": ("llama", 8, 3)}


def _config(bits: int):
    from transformers import BitsAndBytesConfig

    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _adapted(model):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)  # the same adapters on both
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=TARGETS, bias="all"
    )
    return get_peft_model(model, config).train()


def _stacked_quantized(ckpt, bits):
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers.linear4bit import FrozenQuantizedLinear
    from hf_rtp.model.state import state_of

    rank = int(os.environ["RANK"])
    plan = "auto" if "qwen2" in ckpt else None
    model = hf_rtp.from_pretrained(
        ckpt, dtype=torch.float32, plan=plan, quantization_config=_config(bits), rotation_moves="activations"
    )
    vanilla = vanilla_training_path(
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=_config(bits))
    )
    ring = state_of(model).topology.ring
    quantized = [m for m in model.modules() if isinstance(m, FrozenQuantizedLinear)]
    stacked_sets = len({id(m.siblings) for m in quantized if "siblings" in vars(m) and m.siblings.stacked})
    pieces = {local.data_ptr() for m in quantized for local in [m.weight.to_local()]}
    groups = {m: vars(m).pop("siblings") for m in model.modules() if "siblings" in vars(m)}  # each walks alone

    model, vanilla = _adapted(model), _adapted(vanilla)
    ddp = DistributedDataParallel(vanilla)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad and n.endswith(".bias"))
    exchanges, gaps, saved = [], [], []
    for step in range(2):
        batch = global_batch(ring.size, seq=12, seed=step + 1)[rank]
        model.zero_grad(), vanilla.zero_grad()
        before = ring.exchanges
        uint8: list[int] = []

        def pack(t, uint8=uint8):
            if t.dtype == torch.uint8:
                uint8.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        ddp(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        exchanges.append(ring.exchanges - before)
        gaps.append(trainable_grad_gaps(model, vanilla))
        saved.append((len(uint8), all(p in pieces for p in uint8)))
        for m, group in groups.items():  # then stacked
            m.siblings = group

    model.eval(), vanilla.eval()
    prompt = global_batch(ring.size, seq=6, seed=9)[rank]
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    walks, tokens = [], []
    with torch.no_grad():
        for grouped in (False, True):
            for m, group in groups.items():
                if grouped:
                    m.siblings = group
                else:
                    vars(m).pop("siblings", None)
            before = ring.token_walks, ring.exchanges
            model(input_ids=prompt[:, :1])  # a decode step's shape: one token per sequence
            walks.append((ring.token_walks - before[0], ring.exchanges - before[1]))
            tokens.append(model.generate(input_ids=prompt, **options).tolist())
        want = vanilla.generate(input_ids=prompt, **options).tolist()
    return stacked_sets, trained, exchanges, gaps, saved, walks, tokens, want


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_siblings_walk_stacked_and_train_as_vanilla(tmp_path, case):
    arch, bits, world = CASES[case]
    ckpt = make_tiny(arch, tmp_path / f"{arch}-ckpt", **WIDE)
    for rank, (sets, trained, exchanges, gaps, saved, walks, tokens, want) in enumerate(
        run_on_ranks(_stacked_quantized, world, ckpt, bits)
    ):
        assert sets == 4, (rank, sets)  # q/k/v and gate/up in each of the 2 layers
        if arch == "qwen2":  # bias="all": q/k/v's biases train, through the stack in the second step
            assert len(trained) == 6 and all(".self_attn." in n for n in trained), trained
        first, second = exchanges
        # per layer 7 frozen walks become 4, each N-1 hops forward and N-1 in backward (no gradients travel); the
        # first layer's q/k/v walk no backward at all (their input, the frozen embedding's output, takes no
        # gradient): 6 walks fewer forward, 4 fewer backward
        assert first - second == (6 + 4) * (world - 1), (rank, exchanges)
        for step, step_gaps in enumerate(gaps):
            assert sum("lora_A" in n for n in step_gaps) == 10, sorted(step_gaps)
            for name, (difference, scale) in step_gaps.items():
                assert scale > 0 and difference <= 1e-7 + 1e-5 * scale, (rank, step, name, difference, scale)
        # what backward keeps: each member's own piece, as when it walks alone, never a stacked copy (Llama's first
        # q/k/v keep none: nothing of theirs takes a gradient; Qwen2's do, their biases train)
        kept = 2 * 7 if arch == "qwen2" else 2 * 7 - 3
        assert saved[0][0] == saved[1][0] == kept and saved[0][1] and saved[1][1], (rank, saved)
        # a decode step: each quantized member its own token walk, as with no groups (no stacked copy per step)
        assert walks[0] == walks[1] and walks[0][0] >= 2 * 7, (rank, walks)
        assert tokens[0] == tokens[1] == want, (rank, tokens, want)
