"""Plain transformers.Trainer on a rotated model, against the same Trainer on vanilla transformers (DDP).

hf_rtp attaches to the Trainer instance that moves the model to its device; the test uses Trainer
exactly as a script would: save_steps, save_total_limit, evaluation with load_best_model_at_end,
resume_from_checkpoint (exact at the same world size, resharded at another), save_model.
Float64, so "equal to vanilla" can be tight (see test_equivalence); training takes the fused LM-head
loss, whose float32 math sums in another order than vanilla's, so weights after a few AdamW steps
agree up to float32 rounding amplified by Adam (NOISE), where a wrong step would be off by ~lr.
"""

import os
import shutil

import torch
from safetensors.torch import load_file
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks

# Adam's default eps (1e-8) lets float32-sized gradient differences move a weight whose gradient is
# near zero by a visible fraction of a step: allow 0.2% of one (lr 1e-2); a wrong step is off by ~lr.
NOISE = dict(atol=2e-5, rtol=1e-6)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, VOCAB, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@torch.no_grad()
def _full(model) -> dict:
    return {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for n, p in model.named_parameters()
    }


def _trainer(model, out, max_steps=6):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=2,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_drop_last=True,
    )

    class Start(TrainerCallback):  # the weights training starts from, after any resume
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.weights = _full(model)

    class KeepFourth(TrainerCallback):  # save_total_limit deletes checkpoint-4 later: keep a copy to resume from
        def on_save(self, args, state, control, **kwargs):
            if state.global_step != 4:
                return
            # Trainer writes each rank's rng_state_<rank>.pth with no barrier after it: wait for every rank's file
            torch.distributed.barrier()
            if state.is_world_process_zero:
                shutil.copytree(os.path.join(out, "checkpoint-4"), os.path.join(out, "copy-of-checkpoint-4"))

    start = Start()
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(64, 3), eval_dataset=Tokens(6, 4), callbacks=[start, KeepFourth()]
    )
    return trainer, start


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _train_save_resume(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    vanilla, _ = _trainer(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"))
    vanilla.train()
    rotated, _ = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"))
    rotated.train()
    full = _full(rotated.model)
    for name, p in vanilla.model.named_parameters():  # both loaded the same best checkpoint at the end
        torch.testing.assert_close(full[name], p.detach(), **NOISE, msg=lambda m, name=name: f"{name}: {m}")
    best = os.path.basename(rotated.state.best_model_checkpoint)
    assert best == os.path.basename(vanilla.state.best_model_checkpoint)
    kept = sorted(f for f in os.listdir(os.path.join(out, "rotated")) if f.startswith("checkpoint-"))

    final = os.path.join(out, "final")
    rotated.save_model(final)  # Trainer calls this on every rank; with hf_rtp it is collective
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
        assert all(torch.equal(p, full[n]) for n, p in loaded.named_parameters())  # bit-exact in vanilla

    rotated.hub_model_id = "someone/tiny"  # offline: push_to_hub saves collectively, then rank 0's upload fails
    try:
        rotated.push_to_hub()
        pushed = None
    except Exception as err:  # huggingface_hub's offline error, on rank 0 only
        pushed = type(err).__name__
    assert (pushed is not None) == (rank == 0), pushed
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "rotated"), dtype=torch.float64)
        assert all(torch.equal(p, full[n]) for n, p in loaded.named_parameters())  # what it would have uploaded

    resumed, _ = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "rotated"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "rotated", "copy-of-checkpoint-4"))

    # vanilla's checkpoint pickles its optimizer and scheduler: refused, not resumed with both restarted
    from_vanilla, _ = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "from-vanilla"))
    try:
        from_vanilla.train(resume_from_checkpoint=vanilla.state.best_model_checkpoint)
        refused = None
    except hf_rtp.CheckpointError as err:
        refused = str(err)
    assert refused is not None and "optimizer.pt and scheduler.pt" in refused, refused
    assert from_vanilla.state.global_step == 0  # nothing ran
    return _losses(vanilla), _losses(rotated), _losses(resumed), kept, best


def _resume_at_three(ckpt, out):
    import hf_rtp

    trainer, start = _trainer(
        hf_rtp.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "three"), max_steps=8
    )
    checkpoint = os.path.join(out, "rotated", "checkpoint-6")
    trainer.train(resume_from_checkpoint=checkpoint)
    saved = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert all(torch.equal(start.weights[n], saved[n]) for n in saved)  # resharded 2 -> 3, every row in place
    return trainer.state.global_step, len(_losses(trainer))


def _train_as_two_rings_of_two(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    vanilla, _ = _trainer(
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), os.path.join(out, "vanilla"), 4
    )
    vanilla.train()
    rotated, _ = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rtp_size=2), os.path.join(out, "grid"), 4)
    assert hf_rtp.state_of(rotated.model).topology.dp_size == 2
    rotated.train()  # checkpoints at steps 2 and 4 from the grid, then the best of them loaded back
    full = _full(rotated.model)
    for name, p in vanilla.model.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), **NOISE, msg=lambda m, name=name: f"{name}: {m}")
    return _losses(vanilla), _losses(rotated)


def test_trainer_on_two_rings_of_two_trains_like_vanilla_on_four_ranks(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    results = run_on_ranks(_train_as_two_rings_of_two, 4, ckpt, str(tmp_path / "runs"))
    vanilla, rotated = results[0]
    assert len(rotated) == 4
    torch.testing.assert_close(rotated, vanilla, **NOISE)


def test_trainer_saves_resumes_and_loads_the_best_model_like_vanilla(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    out = str(tmp_path / "runs")
    vanilla, rotated, resumed, kept, best = run_on_ranks(_train_save_resume, 2, ckpt, out)[0]
    torch.testing.assert_close(rotated, vanilla, **NOISE)
    assert resumed[-2:] == rotated[-2:]  # steps 5 and 6 after resuming from checkpoint-4: exactly the same
    # save_total_limit=2 keeps the newest and the best checkpoint, as it does in vanilla
    assert kept == sorted({"checkpoint-6", best}), kept
    assert sorted(os.listdir(os.path.join(out, "rotated", "checkpoint-6", "hf_rtp_state")))[-1] == "training_state.json"
    assert run_on_ranks(_resume_at_three, 3, ckpt, out) == [(8, 2 + 6)] * 3
