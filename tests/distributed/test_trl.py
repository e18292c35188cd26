"""TRL's SFTTrainer on a rotated model, full fine-tune and with peft_config, against vanilla under DDP.

TRL replaces the model's forward with a fused LM-head loss that gathers `lm_head.weight` with
`full_tensor()`; on a rotated model hf_rtp installs its own, which computes the same per-token
log-probs, entropy and top-1 in the ring (hf_rtp.integrations.trl). The LoRA run also checks that DDP
wraps the PEFT model without anyone calling ignore_rotated_in_ddp. Float64 model (bf16 autocast off),
losses, logged metrics and every gradient compared.
"""

import os

import pytest
import torch
from safetensors.torch import load_file
from support.models import global_batch, make_tiny, tiny_tokenizer
from support.spawn import run_on_ranks
from support.trainer_grads import first_grads_callback


def _sft(model, out, lora):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ids = global_batch(8, batch=2, seq=10, seed=5).reshape(16, 10).tolist()
    config = SFTConfig(
        output_dir=out,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        max_length=16,
        bf16=False,
    )  # SFTConfig's default autocasts to bf16, where two kernels differ by bf16 rounding
    peft_config = None
    if lora:
        from peft import LoraConfig

        # with "modules_to_save", PEFT trains a copy of the rotated head and embedding, which stay rotated
        peft_config = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules="all-linear",
            init_lora_weights=False,
            modules_to_save=["lm_head", "embed_tokens"] if lora == "modules_to_save" else None,
        )
    grads = first_grads_callback()
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": ids}),
        processing_class=tiny_tokenizer(),
        callbacks=[grads],
        peft_config=peft_config,
    )
    base = trainer.model.get_base_model() if lora else trainer.model
    head = base.forward.__func__.__code__.co_filename  # which fused_lm_head=True forward SFTTrainer installed
    trainer.train()
    logged = [(e["loss"], e["entropy"], e["mean_token_accuracy"]) for e in trainer.state.log_history if "loss" in e]
    trainer.save_model(os.path.join(out, "saved"))  # collective for a rotated model; PEFT's files for adapters
    # numpy: tensors would cross the result queue through shared memory that dies with the process
    return logged, grads.grads, head


def _compare(ckpt, out, lora):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    torch.manual_seed(0)
    vanilla = _sft(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"), lora)
    torch.manual_seed(0)
    rotated = _sft(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"), lora)
    return vanilla, rotated, _asked_for_another_base(ckpt, out) if not lora else None


def _asked_for_another_base(ckpt, out):
    """TRL's scripts hand SFTTrainer model_init_kwargs and quantization_config= for a model it builds from a path;
    given a loaded model, TRL only warns that it ignores them. A rotated model loaded without them is refused."""
    from datasets import Dataset
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    import hf_rtp

    config = SFTConfig(output_dir=os.path.join(out, "asked"), use_cpu=True, report_to=[], bf16=False,
                       model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "eager"})  # fmt: skip
    with pytest.raises(hf_rtp.IntegrationError) as refused:
        SFTTrainer(
            model=hf_rtp.from_pretrained(ckpt, dtype=torch.float32),
            args=config,
            train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}),
            processing_class=tiny_tokenizer(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )
    return str(refused.value)


@pytest.mark.parametrize("lora", [False, True, "modules_to_save"], ids=["full", "peft", "peft-modules-to-save"])
def test_sft_trainer_matches_vanilla_ddp_in_losses_and_every_gradient(tmp_path, lora):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (vanilla_logged, vanilla_grads, vanilla_head), (logged, grads, head), refused = run_on_ranks(
        _compare, 2, ckpt, str(tmp_path), lora
    )[0]
    if not lora:  # every keyword named, and the line that carries them
        for asked in ("dtype='bfloat16'", "attn_implementation='eager'", "quantization_config={quant_method="):
            assert asked in refused, refused
        assert "**training_args.model_init_kwargs, quantization_config=get_quantization_config" in refused
    # the rotated model's per-token log-probs, entropy and top-1 come from the ring, not a gathered head
    assert vanilla_head.endswith(os.path.join("trl", "trainer", "utils.py"))
    # a PEFT copy of the head (modules_to_save) goes to TRL's own fused head, which gathers it (with a warning)
    assert head.endswith(
        os.path.join("trl", "trainer", "utils.py")
        if lora == "modules_to_save"
        else os.path.join("hf_rtp", "integrations", "trl.py")
    )
    assert grads.keys() == vanilla_grads.keys() and ("lm_head.weight" in grads) != bool(lora)
    if lora == "modules_to_save":
        assert "base_model.model.lm_head.modules_to_save.default.weight" in grads
    # two float32 loss kernels (TRL's and hf_rtp's) on a float64 model: ~3e-7 of each gradient's scale
    for name, grad in vanilla_grads.items():
        torch.testing.assert_close(
            torch.from_numpy(grads[name]),
            torch.from_numpy(grad),
            rtol=1e-7,
            atol=2e-6 * abs(grad).max(),
            msg=lambda m, name=name: f"{name}: {m}",
        )
    torch.testing.assert_close(logged, vanilla_logged, atol=1e-6, rtol=1e-6)  # loss, entropy, top-1 accuracy
    saved = {}
    for run in ("vanilla", "rotated"):  # the same files; the same tensors within 0.1% of an Adam step (lr 1e-2)
        folder = tmp_path / run / "saved"
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        saved[run] = (names, {k: v for n in names for k, v in load_file(folder / n).items()})
    assert saved["rotated"][0] == saved["vanilla"][0] and saved["rotated"][1].keys() == saved["vanilla"][1].keys()
    for name, tensor in saved["vanilla"][1].items():
        torch.testing.assert_close(
            saved["rotated"][1][name], tensor, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
