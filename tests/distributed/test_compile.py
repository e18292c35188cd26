"""torch.compile of a rotated model (and Trainer's torch_compile=True, at construction) is refused with a message
that names compile, and leaves the eager model working.

Dynamo cannot capture the ring's point-to-point walk inside autograd Functions, nor trace hf_rtp's
DTensor subclass; before this refusal it failed with the save message ("Save weights with
model.save_pretrained"), a wrong cause and a wrong fix.
"""

import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _compile_then_eager(ckpt, out):
    from transformers import Trainer, TrainingArguments

    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64).train()
    batch = global_batch(2)[rank]
    compiled = torch.compile(model)
    with pytest.raises(Exception) as refused:  # dynamo wraps what its trace raises in its own error type
        compiled(input_ids=batch, labels=batch)
    with pytest.raises(hf_rtp.RotatedStateError) as refused_in_place:
        model.compile()
    torch._dynamo.reset()
    with pytest.raises(hf_rtp.RotatedStateError) as refused_by_trainer:  # at construction, before any step
        Trainer(model=model, args=TrainingArguments(output_dir=out, torch_compile=True, use_cpu=True, report_to=[]))
    loss = model(input_ids=batch, labels=batch).loss  # the eager model, still in step with the other rank
    loss.backward()
    hf_rtp.sync_grads(model)
    return str(refused.value), str(refused_in_place.value), str(refused_by_trainer.value), loss.item()


def test_torch_compile_is_refused_naming_compile_and_the_eager_model_still_trains(tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny("llama", tmp_path / "ckpt")
    results = run_on_ranks(_compile_then_eager, 2, ckpt, str(tmp_path / "out"))
    batches = global_batch(2)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    for rank, (message, in_place, by_trainer, loss) in enumerate(results):
        for text in (message, in_place, by_trainer):
            assert "torch.compile does not trace a model hf_rtp loaded" in text and "Run the model eagerly" in text
            assert "save_pretrained" not in text
        expected = vanilla(input_ids=batches[rank], labels=batches[rank]).loss.item()
        assert abs(loss - expected) < 1e-5, (loss, expected)  # the fused loss computes in float32
