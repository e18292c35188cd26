"""TRL's reference model, which DPOTrainer (ref_model=None) and GRPOTrainer (beta>0) build themselves
from the policy's path.

Before, TRL loaded it with vanilla from_pretrained: numbers equal, but a whole copy on every rank,
silently. Now hf_rtp loads it rotated like the policy. Full fine-tunes against vanilla under DDP in the
same processes, float64: DPO's losses, reward margins and every gradient, with the reference's bytes per
rank against the whole model's; GRPO's losses, KL and rewards, with a whole reward model beside the
policy warned about. What DPO (with WPO's weighting) and GRPO (with a sampling temperature) ask of TRL's fused
LM head runs on the ring for the rotated policy (tests/distributed/test_trl_fused_options.py for the numbers).
"""

import os

import pytest
import torch
from support.models import make_tiny, tiny_tokenizer
from support.spawn import run_on_ranks
from support.trainer_grads import first_grads_callback


def _pairs():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(4)
    words = lambda n: " ".join(f"t{int(i)}" for i in torch.randint(3, 101, (n,), generator=gen))  # noqa: E731
    rows = [{"prompt": words(4), "chosen": words(3), "rejected": words(3)} for _ in range(8)]
    return Dataset.from_list(rows)


def _dpo(model, out):
    from trl import DPOConfig, DPOTrainer

    grads = first_grads_callback()
    config = DPOConfig(
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
        dataset_num_proc=None,
        use_weighting=True,  # WPO: the fused head's log_sum_sq_probs, beside the mean_logits DPO always asks for
    )
    trainer = DPOTrainer(
        model=model, args=config, train_dataset=_pairs(), processing_class=tiny_tokenizer(), callbacks=[grads]
    )
    reference = trainer.ref_model
    head = trainer.model.forward.__func__.__code__.co_filename  # whose fused_lm_head=True forward DPO installed
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in reference.parameters())
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    trainer.train()
    logged = [(e["loss"], e["rewards/margins"]) for e in trainer.state.log_history if "loss" in e]
    import hf_rtp

    return logged, grads.grads, hf_rtp.is_rotated(reference), local, whole, head


def _both(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    torch.manual_seed(0)
    vanilla = _dpo(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"))
    torch.manual_seed(0)
    rotated = _dpo(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"))
    return vanilla, rotated


def test_dpo_reference_built_by_trl_is_rotated_and_training_matches_vanilla_ddp(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for vanilla, (logged, grads, rotated, local, _, head) in run_on_ranks(_both, 2, ckpt, str(tmp_path)):
        vanilla_logged, vanilla_grads, vanilla_rotated, _, whole, vanilla_head = vanilla
        assert rotated and not vanilla_rotated
        assert vanilla_head.endswith(os.path.join("trl", "trainer", "utils.py"))
        assert head.endswith(os.path.join("hf_rtp", "integrations", "trl.py"))  # not TRL's, which gathers the head
        # embedding and head (101 x 32 each) and every projection split in two; norms whole
        assert local < 0.55 * whole, (local, whole)
        assert grads.keys() == vanilla_grads.keys() and "lm_head.weight" in grads
        for name, grad in vanilla_grads.items():  # TRL's and hf_rtp's fused heads: float32 kernels on a float64 model
            torch.testing.assert_close(
                torch.from_numpy(grads[name]),
                torch.from_numpy(grad),
                rtol=1e-6,
                atol=2e-6 * abs(grad).max(),
                msg=lambda m, name=name: f"{name}: {m}",
            )
        torch.testing.assert_close(logged, vanilla_logged, atol=1e-6, rtol=1e-6)


def _grpo(model, reward_model, out):
    import logging

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import hf_rtp

    prompts = Dataset.from_list([{"prompt": f"t{5 + i} t{9 + i} t{20 + i}"} for i in range(8)])

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    config = GRPOConfig(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        bf16=False,
        beta=0.1,
        temperature=0.7,  # sampling, and the fused head's log-probs, at TRL's temperature
        # the head in float32: TRL swaps its forward for F.linear on the weight, which hf_rtp puts back on the ring
        cast_lm_head_to_fp32=True,
    )  # beta > 0: TRL builds a reference
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hf_rtp").addHandler(handler)
    try:  # a whole reward model beside the policy: the same in both runs, warned about beside a rotated one
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[length, reward_model],
            args=config,
            train_dataset=prompts,
            processing_class=tiny_tokenizer(),
            reward_processing_classes=[None, tiny_tokenizer()],
        )
    finally:
        logging.getLogger("hf_rtp").removeHandler(handler)
    rotated = hf_rtp.is_rotated(trainer.ref_model)
    heads = [m.forward.__func__.__code__.co_filename for m in (trainer.model, trainer.ref_model)]
    trainer.train()
    whole = [w for w in warnings if "reward model LlamaForSequenceClassification is whole on every rank" in w]
    return rotated, [(e["loss"], e["kl"], e["reward"]) for e in trainer.state.log_history if "loss" in e], whole, heads


def _grpo_both(ckpt, out):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import hf_rtp

    runs = []
    for load, name in ((AutoModelForCausalLM.from_pretrained, "vanilla"), (hf_rtp.from_pretrained, "rotated")):
        torch.manual_seed(0)  # the reward head's init, then sampling: each rank its own generator, alike in both runs
        reward_model = AutoModelForSequenceClassification.from_pretrained(ckpt, num_labels=1, dtype=torch.float64)
        runs.append(_grpo(load(ckpt, dtype=torch.float64), reward_model, os.path.join(out, name)))
    return runs


def test_grpo_with_a_kl_term_gets_a_rotated_reference_and_matches_vanilla_ddp(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, ((vanilla_rotated, vanilla_logged, vanilla_warned, _), (rotated, logged, warned, heads)) in enumerate(
        run_on_ranks(_grpo_both, 2, ckpt, str(tmp_path))
    ):
        assert rotated and not vanilla_rotated
        # the policy's and the reference's fused heads at temperature 0.7 are hf_rtp's, not TRL's gathered one
        assert all(h.endswith(os.path.join("hf_rtp", "integrations", "trl.py")) for h in heads), heads
        assert not vanilla_warned and len(warned) == (rank == 0), warned  # hf_rtp logs on rank 0
        if rank == 0:
            assert (
                "MB each) beside a rotated policy" in warned[0]
                and "hf_rtp.AutoModelForSequenceClassification" in warned[0]
            )
        assert logged[-1][1] > 0  # the KL to the reference is in the loss: the reference was used
        torch.testing.assert_close(logged, vanilla_logged, atol=1e-6, rtol=1e-6)  # loss, KL, reward


def _delayed_attachment(ckpt, out, flag):
    """DPOTrainer(ref_model=None) whose Trainer.__init__ does not place the model: hf_rtp attaches at the
    first forward, after TRL built the reference whole. Returns what rank 0 logged, and the reference."""
    import logging

    from trl import DPOConfig, DPOTrainer

    import hf_rtp

    class Unplaced(DPOConfig):
        @property
        def place_model_on_device(self):
            return False

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("hf_rtp").addHandler(handler)
    settings = dict(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True)
    settings.update(disable_tqdm=True, save_strategy="no", bf16=False, dataset_num_proc=None)
    config = DPOConfig(**settings, bf16_full_eval=True) if flag == "bf16_full_eval" else Unplaced(**settings)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=config, train_dataset=_pairs(), processing_class=tiny_tokenizer())
    trainer.train()
    return records, hf_rtp.is_rotated(trainer.ref_model)


@pytest.mark.parametrize("flag", ["bf16_full_eval", "place_model_on_device=False"])
def test_a_whole_reference_built_before_a_delayed_attachment_is_warned_with_its_size(tmp_path, flag):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (records, rotated), _ = run_on_ranks(_delayed_attachment, 2, ckpt, str(tmp_path / "out"), flag)
    assert not rotated  # TRL built it before hf_rtp could: its memory is spent, so it is said
    warned = [r for r in records if "DPOTrainer.ref_model" in r]
    assert len(warned) == 1, records
    assert "whole copy on every rank" in warned[0] and " MB each" in warned[0], warned[0]
    assert "ref_model=hf_rtp.from_pretrained(path)" in warned[0], warned[0]
