"""TRL's reference model, which DPOTrainer builds itself from the policy's path when ref_model=None.

Before, TRL loaded it with vanilla from_pretrained: numbers equal, but a whole copy on every rank,
silently. Now hf_rtp loads it rotated like the policy. Full fine-tune against vanilla under DDP in the
same processes, float64: losses, the logged reward margins and every gradient; and the reference's
bytes per rank against the whole model's.
"""

import os

import torch
from support.models import make_tiny, tiny_tokenizer
from support.spawn import run_on_ranks


def _pairs():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(4)
    words = lambda n: " ".join(f"t{int(i)}" for i in torch.randint(3, 101, (n,), generator=gen))  # noqa: E731
    rows = [{"prompt": words(4), "chosen": words(3), "rejected": words(3)} for _ in range(8)]
    return Dataset.from_list(rows)


def _dpo(model, out):
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class FirstGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                with torch.no_grad():
                    self.grads = {n.removeprefix("module."): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                  else p.grad.clone()).numpy() for n, p in model.named_parameters() if p.grad is not None}

    grads = FirstGrads()
    config = DPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                       report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no", bf16=False,
                       dataset_num_proc=None)
    trainer = DPOTrainer(model=model, args=config, train_dataset=_pairs(), processing_class=tiny_tokenizer(),
                         callbacks=[grads])
    reference = trainer.ref_model
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in reference.parameters())
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    trainer.train()
    logged = [(e["loss"], e["rewards/margins"]) for e in trainer.state.log_history if "loss" in e]
    import hf_rtp

    return logged, grads.grads, hf_rtp.is_rotated(reference), local, whole


def _both(ckpt, out):
    import hf_rtp
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    vanilla = _dpo(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"))
    torch.manual_seed(0)
    rotated = _dpo(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"))
    return vanilla, rotated


def test_dpo_reference_built_by_trl_is_rotated_and_training_matches_vanilla_ddp(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for (vanilla_logged, vanilla_grads, vanilla_rotated, _, whole), (logged, grads, rotated, local, _) in run_on_ranks(
            _both, 2, ckpt, str(tmp_path)):
        assert rotated and not vanilla_rotated
        # embedding and head (101 x 32 each) and every projection split in two; norms whole
        assert local < 0.55 * whole, (local, whole)
        assert grads.keys() == vanilla_grads.keys() and "lm_head.weight" in grads
        for name, grad in vanilla_grads.items():  # TRL's and hf_rtp's fused heads: float32 kernels on a float64 model
            torch.testing.assert_close(torch.from_numpy(grads[name]), torch.from_numpy(grad), rtol=1e-6,
                                       atol=2e-6 * abs(grad).max(), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(logged, vanilla_logged, atol=1e-6, rtol=1e-6)


def _grpo(model, out):
    import hf_rtp
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_list([{"prompt": f"t{5 + i} t{9 + i} t{20 + i}"} for i in range(8)])

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    config = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, num_generations=2,
                        max_completion_length=4, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                        disable_tqdm=True, save_strategy="no", bf16=False, beta=0.1)  # beta > 0: TRL builds a reference
    trainer = GRPOTrainer(model=model, reward_funcs=length, args=config, train_dataset=prompts,
                          processing_class=tiny_tokenizer())
    rotated = hf_rtp.is_rotated(trainer.ref_model)
    trainer.train()
    return rotated, [(e["loss"], e["kl"], e["reward"]) for e in trainer.state.log_history if "loss" in e]


def _grpo_both(ckpt, out):
    import hf_rtp
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # sampling: each rank draws from its own generator, seeded alike in both runs
    vanilla = _grpo(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"))
    torch.manual_seed(0)
    return vanilla, _grpo(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"))


def test_grpo_with_a_kl_term_gets_a_rotated_reference_and_matches_vanilla_ddp(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for (vanilla_rotated, vanilla_logged), (rotated, logged) in run_on_ranks(_grpo_both, 2, ckpt, str(tmp_path)):
        assert rotated and not vanilla_rotated
        assert logged[-1][1] > 0  # the KL to the reference is in the loss: the reference was used
        torch.testing.assert_close(logged, vanilla_logged, atol=1e-6, rtol=1e-6)  # loss, KL, reward
