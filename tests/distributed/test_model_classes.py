"""Model classes beyond causal LMs: reward models and classifiers, loaded by hf_rtp.AutoModelFor...

The usual start of a reward model is a causal LM's checkpoint loaded with a one-label head, which the
checkpoint lacks: vanilla initialises it from the seed, hf_rtp must initialise the same values (rank 0's,
as DDP broadcasts them). TRL's RewardTrainer and a token classifier's backward are then compared with
vanilla under DDP in the same processes, in float64: losses and every gradient; the saved reward model
loads in vanilla.
"""

import os

import pytest
import torch
from support.models import VOCAB, global_batch, make_tiny, tiny_tokenizer
from support.spawn import run_on_ranks
from support.trainer_grads import first_grads_callback


def _reward(model, out):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    rows = global_batch(8, batch=2, seq=8, seed=3).reshape(16, 8)
    data = Dataset.from_dict({"chosen_ids": rows[:8].tolist(), "rejected_ids": rows[8:].tolist()})
    grads = first_grads_callback()
    config = RewardConfig(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        bf16=False,
    )
    trainer = RewardTrainer(
        model=model, args=config, train_dataset=data, processing_class=tiny_tokenizer(), callbacks=[grads]
    )
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.save_model(os.path.join(out, "saved"))
    return losses, grads.grads


def _reward_both(ckpt, out):
    from transformers import AutoModelForSequenceClassification

    import hf_rtp

    torch.manual_seed(0)
    vanilla = AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=1, dtype=torch.float64)
    head = vanilla.score.weight.detach().clone()
    vanilla_run = _reward(vanilla, os.path.join(out, "vanilla"))
    torch.manual_seed(0)
    model = hf_rtp.AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=1, dtype=torch.float64)
    assert torch.equal(model.score.weight, head)  # the new head: vanilla's values under the same seed
    return vanilla_run, _reward(model, os.path.join(out, "rotated"))


def test_reward_trainer_from_a_causal_checkpoint_matches_vanilla_ddp_and_saves_for_vanilla(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (vanilla_losses, vanilla_grads), (losses, grads) = run_on_ranks(_reward_both, 2, ckpt, str(tmp_path))[0]
    assert grads.keys() == vanilla_grads.keys() and "score.weight" in grads and "lm_head.weight" not in grads
    for name, grad in vanilla_grads.items():
        torch.testing.assert_close(
            torch.from_numpy(grads[name]),
            torch.from_numpy(grad),
            rtol=1e-9,
            atol=1e-12,
            msg=lambda m, name=name: f"{name}: {m}",
        )
    torch.testing.assert_close(losses, vanilla_losses, rtol=1e-9, atol=0)
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    saved = tmp_path / "rotated" / "saved"
    reloaded = AutoModelForSequenceClassification.from_pretrained(saved, dtype=torch.float64)
    assert type(reloaded).__name__ == "LlamaForSequenceClassification" and reloaded.config.num_labels == 1
    expected = load_file(tmp_path / "vanilla" / "saved" / "model.safetensors")
    written = {}
    for name in os.listdir(saved):
        if name.endswith(".safetensors"):
            written.update(load_file(saved / name))
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(
            written[name], tensor, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}"
        )


def _token_classes(ckpt, world):
    from transformers import AutoModelForTokenClassification

    import hf_rtp

    rank = int(os.environ.get("RANK", 0))
    batch = global_batch(world, seq=7)
    labels = (batch * 7) % 3
    torch.manual_seed(0)
    vanilla = AutoModelForTokenClassification.from_pretrained(ckpt, num_labels=3, dtype=torch.float64)
    vanilla(input_ids=batch.flatten(0, 1), labels=labels.flatten(0, 1)).loss.backward()
    torch.manual_seed(0)
    model = hf_rtp.from_pretrained(ckpt, auto_class=AutoModelForTokenClassification, num_labels=3, dtype=torch.float64)
    model(input_ids=batch[rank], labels=labels[rank]).loss.backward()
    hf_rtp.sync_grads(model)
    differences = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        differences[name] = (grad - vanilla.get_parameter(name).grad).abs().max().item()
    return type(model).__name__, hf_rtp.state_of(model).resolution.rotated_params, differences


def test_token_classification_gradients_equal_vanilla_ddp(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for name, rotated, differences in run_on_ranks(_token_classes, 2, ckpt, 2):
        assert name == "LlamaForTokenClassification"
        assert "model.embed_tokens.weight" in rotated and not {"score.weight", "score.bias"} & rotated
        assert max(differences.values()) < 1e-12, differences  # mean of per-rank means: vanilla's mean at equal counts


def test_a_head_the_checkpoint_was_not_saved_as_or_hf_rtp_does_not_load_is_named(tmp_path):
    from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

    import hf_rtp

    ckpt = make_tiny("llama", tmp_path / "ckpt")
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match="does not load AutoModelForQuestionAnswering; supported "
        "classes: AutoModelForCausalLM, AutoModelForSequenceClassification",
    ):
        hf_rtp.from_pretrained(ckpt, auto_class=AutoModelForQuestionAnswering)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=2).save_pretrained(tmp_path / "classifier")
    with pytest.raises(
        hf_rtp.UnsupportedModelError,
        match=r"is a LlamaForSequenceClassification \(config.architectures\), "
        r"not a causal LM: load it with hf_rtp.AutoModelForSequenceClassification.from_pretrained",
    ):
        hf_rtp.from_pretrained(tmp_path / "classifier")
    model = hf_rtp.AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier")
    assert model.config.num_labels == 2 and model.config.vocab_size == VOCAB
    # a head that is absent from a checkpoint only for a class that adds one: a causal LM's lm_head is never invented
    with pytest.raises(hf_rtp.CheckpointError, match="lacks 1 tensor"):
        hf_rtp.from_pretrained(tmp_path / "classifier", auto_class=hf_rtp.AutoModelForCausalLM.auto_class)
