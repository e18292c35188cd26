"""Trainers that never move the model to its device are attached all the same, never left to save rank 0's rows.

hf_rtp attaches itself to a Trainer when Trainer.__init__ moves the model (integrations/trainer.py). With
bf16_full_eval=True, or arguments whose place_model_on_device is False, it does not, and SFTTrainer then
installs TRL's own fused LM head, which gathers the whole head on every rank. hf_rtp attaches such a Trainer
when train() moves the model or at its first forward, and takes the head over; model_init reloads the model
inside train(). Each run beside vanilla under DDP in the
same processes (float64): losses equal, and what save_model writes loads in vanilla as the trained weights.
"""

import os

import pytest
import torch
from support.models import global_batch, make_tiny, tiny_tokenizer
from support.spawn import run_on_ranks


def _sft(model, out, **extra):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ids = global_batch(8, batch=2, seq=10, seed=5).reshape(16, 10).tolist()
    config = SFTConfig(
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
        max_length=16,
        bf16=False,
        **extra,
    )
    return SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": ids}), processing_class=tiny_tokenizer()
    )


def _unplaced_arguments():
    """TrainingArguments whose place_model_on_device is False, as transformers documents it: by subclassing
    (module-level, so that Trainer can pickle it into training_args.bin)."""
    from transformers import TrainingArguments

    global Unplaced
    if "Unplaced" not in globals():  # one class per process: transformers is imported only once ranks start

        class Unplaced(TrainingArguments):
            @property
            def place_model_on_device(self):
                return False

        Unplaced.__qualname__ = "Unplaced"
    return Unplaced


def _trainer(out, model=None, model_init=None, placed=True, **extra):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = (TrainingArguments if placed else _unplaced_arguments())(
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
        **extra,
    )
    ids = global_batch(8, batch=2, seq=10, seed=6).reshape(16, 10)
    data = [{"input_ids": row} for row in ids]
    # no processing_class: Trainer then saves the collator's tokenizer beside the model
    return Trainer(
        model=model,
        model_init=model_init,
        args=args,
        train_dataset=data,
        eval_dataset=data[:4],
        data_collator=DataCollatorForLanguageModeling(tiny_tokenizer(), mlm=False),
    )


def _losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _saved_like(trainer, out):
    """save_model on every rank; rank 0 returns what vanilla reads back from it, and the tokenizer's presence."""
    from transformers import AutoModelForCausalLM

    trainer.save_model(out)
    with torch.no_grad():
        full = {
            n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in trainer.model.named_parameters()
        }
    if int(os.environ["RANK"]) != 0:
        return None
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    same = all(torch.equal(full[n], p) for n, p in reloaded.named_parameters())
    return same, os.path.exists(os.path.join(out, "tokenizer_config.json"))


def _attached(trainer) -> bool:
    return bool(trainer.__dict__.get("_hf_rtp_attached"))


def _three_trainers(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    def vanilla():
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)

    def rotated():
        return hf_rtp.from_pretrained(ckpt, dtype=torch.float64)

    results = {}
    # SFTTrainer that does not place the model: TRL's own head goes on in __init__, before any attachment
    torch.manual_seed(0)
    ref = _sft(vanilla(), os.path.join(out, "sft-vanilla"), bf16_full_eval=True)
    ref.train()
    torch.manual_seed(0)
    sft = _sft(rotated(), os.path.join(out, "sft"), bf16_full_eval=True)
    attached_before = _attached(sft)
    sft.train()
    head = sft.model.forward.__func__.__code__.co_filename
    results["sft"] = (
        attached_before,
        _attached(sft),
        head,
        _losses(sft),
        _losses(ref),
        _saved_like(sft, os.path.join(out, "sft-saved")),
    )

    # place_model_on_device False: never placed; evaluate() alone, then save_model
    evaluated = _trainer(os.path.join(out, "eval"), model=rotated(), placed=False)
    ref_eval = _trainer(os.path.join(out, "eval-vanilla"), model=vanilla(), placed=False)
    attached_before = _attached(evaluated)
    try:  # saved before any forward: Trainer's main-process save would leave the other ranks out
        evaluated.save_model(os.path.join(out, "too-early"))
        refused = None
    except hf_rtp.IntegrationError as err:
        refused = str(err)
    loss, ref_loss = evaluated.evaluate()["eval_loss"], ref_eval.evaluate()["eval_loss"]
    results["unplaced"] = (
        attached_before,
        refused,
        _attached(evaluated),
        loss,
        ref_loss,
        _saved_like(evaluated, os.path.join(out, "eval-saved")),
    )

    # model_init: the model is built in __init__ and again inside train()
    torch.manual_seed(0)
    ref_init = _trainer(os.path.join(out, "init-vanilla"), model_init=vanilla)
    ref_init.train()
    torch.manual_seed(0)
    init = _trainer(os.path.join(out, "init"), model_init=rotated)
    attached_before = _attached(init)
    init.train()
    results["model_init"] = (
        attached_before,
        _attached(init),
        _losses(init),
        _losses(ref_init),
        _saved_like(init, os.path.join(out, "init-saved")),
    )
    return results


def test_trainers_that_do_not_place_the_model_are_attached_and_train_and_save_like_vanilla(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    results = run_on_ranks(_three_trainers, 2, ckpt, str(tmp_path))
    for rank, result in enumerate(results):
        attached_before, attached, head, losses, ref_losses, saved = result["sft"]
        assert (attached_before, attached) == (False, True)
        assert head.endswith(os.path.join("hf_rtp", "integrations", "trl.py"))  # TRL's gathered head taken over
        torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=1e-6)
        attached_before, refused, attached, loss, ref_loss, eval_saved = result["unplaced"]
        assert (attached_before, attached) == (False, True)
        if rank == 0:  # the main process saves alone there: refused, naming the fix
            assert "never attached" in refused and "hf_rtp.attach_trainer(trainer)" in refused
        else:
            assert refused is None
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        attached_before, attached, losses, ref_losses, init_saved = result["model_init"]
        assert (attached_before, attached) == (True, True)
        torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=1e-6)
        if rank == 0:  # vanilla reads back exactly the trained weights; the collator's tokenizer is saved too
            assert saved == (True, True) and eval_saved == (True, True) and init_saved == (True, True)


def test_attach_trainer_refuses_a_trainer_whose_replaced_methods_changed(tmp_path):
    from transformers import Trainer, TrainingArguments

    import hf_rtp

    class Changed(Trainer):
        def _load_best_model(self, strict):  # a future transformers could pass more
            return super()._load_best_model()

    model = hf_rtp.from_pretrained(make_tiny("llama", tmp_path / "ckpt"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    with pytest.raises(hf_rtp.IntegrationError, match=r"Changed._load_best_model takes \['self', 'strict'\]"):
        Changed(model=model, args=args)  # attached as it moves the model: refused there
