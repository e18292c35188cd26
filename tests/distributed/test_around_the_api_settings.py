"""The settings next to test_around_the_api.py's, each beside vanilla in the same processes at 2 ranks:
- Trainer on a PEFT prompt-tuning model (Trainer wraps it in DDP under the PeftModel's own prefixes): the first
  step's gradients and the losses equal vanilla Trainer's;
- TRL's SFTTrainer after `resize_token_embeddings` and transformers' mean initialisation of the new rows;
- accelerate's `prepare` around a user's wrapper holding the model under a name of its own;
- bf16: the new-token recipe and row assignments, and adapters made under per-rank seeds.
"""

import os

import torch
from support.models import VOCAB, global_batch, make_tiny_llama, tiny_tokenizer
from support.spawn import run_on_ranks
from support.trainer_grads import first_grads_callback

DTYPE = torch.float64


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, VOCAB, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _prompt_trainer(model, out):
    from peft import PromptTuningConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    args = TrainingArguments(
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
    )
    grads = first_grads_callback()
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(16, 3), callbacks=[grads])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    prompt = model.prompt_encoder.default.embedding.weight.detach().numpy().copy()
    return losses, grads.grads, prompt


def _resized_sft(model, out):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(1)
    model.resize_token_embeddings(model.config.vocab_size + 3)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    emb.data[-3:] = emb.data[:-3].mean(0)  # transformers' recipe for new tokens
    head.data[-3:] = head.data[:-3].mean(0)
    ids = global_batch(8, batch=2, seq=10, seed=5).reshape(16, 10)
    ids[:, 3] = VOCAB + 1  # the batches use a new token
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
    )
    grads = first_grads_callback()
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        processing_class=tiny_tokenizer(),
        callbacks=[grads],
    )
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], grads.grads


class _Wrapper(torch.nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.value = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)

    def forward(self, ids):
        out = self.backbone(input_ids=ids, labels=ids, output_hidden_states=True)
        return out.loss + self.value(out.hidden_states[-1]).pow(2).mean()


def _accelerate_wrapper(model, batch):
    from accelerate import Accelerator

    torch.manual_seed(0)
    wrapper = _Wrapper(model.train())
    accelerator = Accelerator(cpu=True)
    wrapper, optimizer = accelerator.prepare(wrapper, torch.optim.SGD(wrapper.parameters(), lr=1e-2))
    accelerator.backward(wrapper(batch))
    inner = accelerator.unwrap_model(wrapper)
    grads = {n: p.grad.clone() for n, p in inner.named_parameters()}
    optimizer.step()
    return grads, {n: p.detach() for n, p in inner.named_parameters()}


def _bf16(ckpt, batch, rank):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    for m in (model, ref):
        emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
        emb.data[-3:] = emb.data[:-3].mean(0)
        with torch.no_grad():
            head[[1, 60, 100]] = 0.5
    for name, p in model.named_parameters():  # bit for bit: assignment is exact in any dtype
        theirs = dict(ref.named_parameters())[name].detach()
        if hasattr(p, "to_local"):
            from hf_rtp.distributed.tensors.rotated import local_rows

            start, end = local_rows(p)
            assert torch.equal(p.to_local(), theirs[start:end]), name
        else:
            assert torch.equal(p.detach(), theirs), name
    torch.manual_seed(7 + rank)  # a per-rank seed before get_peft_model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    lora = get_peft_model(model.train(), config)
    lora(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(lora)
    adapters = [p.detach().float() for p in lora.parameters() if p.requires_grad]
    everyone = [torch.zeros_like(torch.cat([a.flatten() for a in adapters])) for _ in range(2)]
    torch.distributed.all_gather(everyone, torch.cat([a.flatten() for a in adapters]))
    assert torch.equal(everyone[0], everyone[1])  # one set of adapters: rank 0's


def _cases(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    batch = global_batch(2)[rank]
    results = {}
    results["prompt"] = [
        _prompt_trainer(load(ckpt, dtype=DTYPE), os.path.join(out, name))
        for name, load in (("vanilla", AutoModelForCausalLM.from_pretrained), ("rotated", hf_rtp.from_pretrained))
    ]
    results["sft"] = [
        _resized_sft(load(ckpt, dtype=DTYPE), os.path.join(out, "sft-" + name))
        for name, load in (("vanilla", AutoModelForCausalLM.from_pretrained), ("rotated", hf_rtp.from_pretrained))
    ]
    vanilla = _accelerate_wrapper(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE), batch)
    rotated = _accelerate_wrapper(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False), batch)
    for mine, theirs in zip(rotated, vanilla, strict=True):  # gradients, then the weights after an SGD step
        for name, value in mine.items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(whole, theirs[name], atol=1e-10, rtol=1e-7, msg=name)
    _bf16(ckpt, batch, rank)
    return results


def _assert_grads(vanilla: dict, rotated: dict):
    assert vanilla.keys() == rotated.keys() and vanilla
    for name in vanilla:  # the fused loss sums in float32: float32 rounding, where a wrong mean is off by ~1
        torch.testing.assert_close(torch.as_tensor(rotated[name]), torch.as_tensor(vanilla[name]), atol=1e-7, rtol=1e-5)


def test_trainer_trl_accelerate_and_bf16_around_the_api_equal_vanilla(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    for results in run_on_ranks(_cases, 2, ckpt, str(tmp_path / "out")):
        (v_losses, v_grads, v_prompt), (r_losses, r_grads, r_prompt) = results["prompt"]
        assert any(n.startswith("prompt_encoder") for n in r_grads)
        _assert_grads(v_grads, r_grads)
        torch.testing.assert_close(r_losses, v_losses, atol=1e-5, rtol=1e-5)
        # 3 AdamW steps amplify the fused loss's float32 rounding; a wrong step is off by ~lr (1e-2)
        torch.testing.assert_close(torch.as_tensor(r_prompt), torch.as_tensor(v_prompt), atol=2e-4, rtol=1e-5)
        (v_losses, v_grads), (r_losses, r_grads) = results["sft"]
        _assert_grads(v_grads, r_grads)
        torch.testing.assert_close(r_losses, v_losses, atol=1e-5, rtol=1e-5)
