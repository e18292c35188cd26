"""Context parallelism one setting away from the paths test_context_parallel.py covers, each beside vanilla
transformers on the whole sequence in the same run: every `rope_type` transformers registers, the loss's one
meaning whatever keywords the caller passes, the docs' own loop, logits and `context_parallel_unshard`, the buffers
a user hands accelerate's `maybe_context_parallel`, sequences the ring cannot cut, and Trainer's options and eval.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, STEP_ATOL, assert_matches
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks

# every rope_type of transformers' ROPE_INIT_FUNCTIONS, and the default. dynamic and longrope read the largest
# position they are given: with 41 tokens at 2 ranks rank 0 holds the last chunk (position 40) and rank 1 at most
# position 30, on either side of the original 32 (longrope's long or short factors) and past 16 (dynamic's scaling)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "original_max_position_embeddings": 32,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "proportional": {"rope_type": "proportional", "rope_theta": 10000.0},
}
SEQ = 41
DOCS = Path(__file__).resolve().parents[2] / "docs" / "context-parallel.md"


def _ids(seq: int = SEQ, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _both(path, **rtp):
    """hf_rtp's model (with `rtp`, its own keywords) and vanilla's, float64, SDPA, in train mode."""
    from transformers import AutoModelForCausalLM

    import hf_rtp

    options = dict(dtype=torch.float64, attn_implementation="sdpa")
    model = hf_rtp.from_pretrained(path, **options, **rtp).train()
    return model, AutoModelForCausalLM.from_pretrained(path, **options).train()


def _ropes(paths: dict) -> list[str]:
    import torch.distributed as dist

    import hf_rtp

    checked = []
    for name, path in paths.items():
        model, ref = _both(path)
        world, rank = dist.get_world_size(), dist.get_rank()
        ids = _ids()
        batch = {"input_ids": ids, "labels": ids.clone()}
        with hf_rtp.context_parallel(model, batch):
            loss = model(**batch).loss
            loss.backward()
        hf_rtp.sync_grads(model)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL, trainable=True)
        checked.append(name)
    return checked


def test_every_rope_type_computes_its_frequencies_from_the_whole_sequence(tmp_path):
    """dynamic and longrope choose frequencies by the largest position: a rank without the last chunk rotated with
    others (gradients 7e-5 off at dynamic). Every registered type's loss and gradients are vanilla's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPES)  # a new type in transformers is added here
    paths = {}
    for name, rope in ROPES.items():
        longest = 64 if name == "longrope" else 16  # longrope's factor: max / original
        paths[name] = make_tiny("llama", tmp_path / name, max_position_embeddings=longest, rope_parameters=rope)
    assert run_on_ranks(_ropes, 2, paths) == [list(ROPES)] * 2


def _docs_loop(path: str):
    """The plain loop exactly as docs/context-parallel.md shows it; without its sync_grads, refused at the step;
    num_items_in_batch (vanilla's divisor over accumulated micro-batches) with vanilla's meaning; logits cut and
    put back together with context_parallel_unshard."""
    import torch.distributed as dist

    import hf_rtp

    block = re.search(r"\*\*A plain torchrun loop:\*\*\n\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert block is not None
    model, ref = _both(path)
    world, rank = dist.get_world_size(), dist.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = _ids(), _ids()
    labels[0, :5] = -100
    exec(block.group(1), {"torch": torch, "hf_rtp": hf_rtp, "model": model, "optimizer": optimizer, "ids": ids,
                          "labels": labels})  # fmt: skip
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(input_ids=ids, labels=labels).loss.backward()
    ref_optimizer.step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)  # the stepped weights, norms included

    with pytest.raises(hf_rtp.UnsyncedGradientsError, match="sync_grads"):  # the same loop, its sync left out
        batch = {"input_ids": ids, "labels": labels}
        with hf_rtp.context_parallel(model, batch):
            model(**batch).loss.backward()
        optimizer.step()
    optimizer.zero_grad()
    ref_optimizer.zero_grad()

    # two micro-batches normalised by their label tokens together: vanilla's loss for those keywords on each
    count = sum(int((b[:, 1:] != -100).sum()) for b in (labels, ids))
    losses, ref_losses = [], []
    for tokens, targets in ((ids, labels), (ids.flip(1), ids)):
        batch = {"input_ids": tokens, "labels": targets, "num_items_in_batch": torch.tensor(count)}
        with hf_rtp.context_parallel(model, batch):
            losses.append(model(**batch).loss)
            losses[-1].backward()
        ref_losses.append(ref(input_ids=tokens, labels=targets, num_items_in_batch=torch.tensor(count)).loss)
        ref_losses[-1].backward()
    hf_rtp.sync_grads(model)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), atol=1e-7, rtol=1e-6)
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL, trainable=True)

    # input_ids by position and position_ids of one row, as vanilla accepts them; embeddings that require grad
    optimizer.zero_grad()
    ref_optimizer.zero_grad()
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)[None]}
    with torch.no_grad(), hf_rtp.context_parallel(model, batch):
        rest = {k: v for k, v in batch.items() if k != "input_ids"}
        positional = model(batch["input_ids"], **rest).loss
    torch.testing.assert_close(positional, ref(input_ids=ids, labels=labels).loss.detach(), atol=1e-7, rtol=1e-6)
    embeds = model.get_input_embeddings()(ids)
    assert embeds.requires_grad
    batch = {"inputs_embeds": embeds, "labels": labels}
    with hf_rtp.context_parallel(model, batch):
        loss = model(**batch).loss
        loss.backward()
    ref_loss = ref(inputs_embeds=ref.get_input_embeddings()(ids), labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6)
    hf_rtp.sync_grads(model)
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL, trainable=True)
    with pytest.raises(hf_rtp.SettingError, match="different num_items_in_batch"):  # a count of a rank's cut
        batch = {"input_ids": ids, "labels": labels, "num_items_in_batch": torch.tensor(10 + rank)}
        with hf_rtp.context_parallel(model, batch):
            model(**batch).loss.backward()

    # a training forward with labels builds no logits (the fused loss): unsharding them is refused by name on every
    # rank, also where one rank alone passes None (the other's gather would wait for it)
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad(), hf_rtp.context_parallel(model, batch):
        logits = model(**batch).logits
        assert logits is None
        with pytest.raises(hf_rtp.SettingError, match=r"buffer 0 is None.*return_logits=True.*fused_loss=False"):
            hf_rtp.context_parallel_unshard(model, [logits], [1])
        mine = None if rank == 0 else torch.zeros(2, len(hf_rtp.model.context.active(model).positions()), VOCAB)
        with pytest.raises(hf_rtp.SettingError, match=("rank 0 failed: " if rank else "") + "context_parallel_unshard"):
            hf_rtp.context_parallel_unshard(model, [mine], [1])

    unfused, ref = _both(path, fused_loss=False)
    batch = {"input_ids": ids}
    with torch.no_grad(), hf_rtp.context_parallel(unfused, batch):
        logits = unfused(**batch).logits
        assert logits.shape == (2, len(hf_rtp.model.context.active(unfused).positions()), VOCAB)
        (whole,) = hf_rtp.context_parallel_unshard(unfused, [logits], [1])
    with torch.no_grad():
        torch.testing.assert_close(whole, ref(input_ids=ids).logits, atol=1e-9, rtol=1e-7)
    with pytest.raises(hf_rtp.SettingError, match="inside the model's context-parallel block"):
        hf_rtp.context_parallel_unshard(unfused, [logits], [1])
    return [round(x.item(), 9) for x in losses]


def test_the_docs_loop_the_loss_keywords_and_the_logits_are_vanillas(tmp_path):
    path = make_tiny("llama", tmp_path / "llama")
    losses = run_on_ranks(_docs_loop, 2, path)
    assert losses[0] == losses[1]


def _buffers(path: str):
    """The docs' accelerate example with labels = input_ids (one tensor listed twice): vanilla's step. Buffers
    sharing storage, a mask left out of the buffers, a sequence shorter than 2N: the same named error everywhere."""
    import torch.distributed as dist
    from accelerate import ParallelismConfig

    import hf_rtp

    model, ref = _both(path)
    world, rank = dist.get_world_size(), dist.get_rank()
    accelerator = hf_rtp.Accelerator(parallelism_config=ParallelismConfig(cp_size=world))
    prepared = accelerator.prepare(model)
    ids = _ids(batch=1)
    batch = {"input_ids": ids.clone()}
    batch["labels"] = batch["input_ids"]  # one tensor, listed twice below
    batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    batch["position_ids"] = torch.arange(SEQ).expand_as(batch["input_ids"])
    buffers = [batch[k] for k in ("input_ids", "labels", "shift_labels", "position_ids")]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set(buffers)):
        loss = prepared(**batch).loss
        accelerator.backward(loss)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6)
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL, trainable=True)

    seen = []

    def refused(match, tokens, extra=None, views=False):
        batch = {"input_ids": tokens.clone(), "position_ids": torch.arange(tokens.shape[1]).expand_as(tokens)}
        batch["labels"] = batch["input_ids"][:, :] if views else batch["input_ids"].clone()
        batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        batch.update(extra or {})
        buffers = [
            batch[k] for k in ("input_ids", "labels", "shift_labels", "position_ids", "inputs_embeds") if k in batch
        ]
        block = accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers))
        with pytest.raises(hf_rtp.SettingError, match=match), block:
            accelerator.backward(prepared(**batch).loss)
        seen.append(match)

    refused("buffers 0 and 1 are different tensors sharing storage", ids, views=True)
    embeds = model.get_input_embeddings()(ids)  # cut in place, as accelerate's contract has it: autograd refuses
    refused("buffer 4 requires grad", ids, {"inputs_embeds": embeds})
    refused(r"attention_mask holds the whole sequence's 41 tokens.*left out", ids, {"attention_mask": ids * 0 + 1})
    refused(f"a sequence of 3 tokens is shorter than the {2 * world} chunks", ids[:, :3])
    return seen


def test_buffers_the_ring_cannot_cut_are_named_and_one_listed_twice_is_cut_once(tmp_path):
    path = make_tiny("llama", tmp_path / "llama")
    assert len({len(r) for r in run_on_ranks(_buffers, 2, path)}) == 1


def test_a_sequence_shorter_than_the_chunks_is_refused_on_every_rank_at_three(tmp_path):
    """At 3 ranks a 5-token sequence leaves rank 2 without tokens (6 chunks): the same error on each rank."""
    path = make_tiny("llama", tmp_path / "llama")
    errors = run_on_ranks(_short, 3, path)
    assert len(set(errors)) == 1 and "shorter than the 6 chunks" in errors[0]


def _short(path: str) -> str:
    import hf_rtp

    model = hf_rtp.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").train()
    batch = {"input_ids": _ids(5), "labels": _ids(5)}
    with pytest.raises(hf_rtp.SettingError) as caught, hf_rtp.context_parallel(model, batch):
        model(**batch).loss.backward()
    return str(caught.value)


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, n, seq=SEQ):
        self.items = [{"input_ids": _ids(seq, 1, s)[0], "labels": _ids(seq, 1, s)[0]} for s in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(path: str, out: str):
    """Trainer under context parallelism: evaluate() before training is vanilla's eval loss, and after a step;
    predict() and compute_metrics refused; label smoothing, compute_loss_func and NEFTune refused at the first
    forward, before any step."""
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_rtp

    options = dict(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        max_steps=1,
        learning_rate=1e-2,
    )
    data = _Sequences(2)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").eval()

    def vanilla_eval() -> float:  # Trainer's eval loss: the mean over batches of each batch's token mean
        with torch.no_grad():
            return sum(ref(**{k: v[None] for k, v in item.items()}).loss.item() for item in data.items) / 2

    def build(**extra):
        args = TrainingArguments(**options, **extra)
        hf_rtp.Accelerator(parallelism_config=ParallelismConfig(cp_size=2))  # the CPU's line (docs)
        model = hf_rtp.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
        return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data), model

    trainer, model = build(eval_strategy="steps", eval_steps=1)  # and an evaluation inside train(), after its step
    results = {"before": trainer.evaluate()["eval_loss"], "vanilla before": vanilla_eval()}
    with pytest.raises(hf_rtp.SettingError, match="evaluation loss only"):
        trainer.predict(data)
    trainer.train()
    with torch.no_grad():  # vanilla given the weights the step made
        for name, p in model.named_parameters():
            ref.get_parameter(name).copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
    results.update({"after": trainer.evaluate()["eval_loss"], "vanilla after": vanilla_eval()})
    results["between"] = next(entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry)

    refusals = {
        "label_smoothing_factor=0.1": dict(label_smoothing_factor=0.1),
        "neftune_noise_alpha=5": dict(neftune_noise_alpha=5.0),
        "compute_metrics with an evaluation during training": dict(eval_strategy="steps", eval_steps=1),
    }
    for match, extra in refusals.items():
        trainer, model = build(**extra)
        trainer.compute_metrics = lambda prediction: {}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(hf_rtp.SettingError, match=match):
            trainer.train()
        assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())  # nothing stepped
    trainer, model = build(bf16_full_eval=True)  # a Trainer that does not place its model is attached at a forward
    with pytest.raises(hf_rtp.SettingError, match="attached to hf_rtp only at its first forward"):
        trainer.evaluate()  # before train(), whose DDP wrap would have attached it
    trainer, model = build()
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    with pytest.raises(hf_rtp.SettingError, match="compute_loss_func"):
        trainer.train()
    trainer, model = build()
    trainer.compute_metrics = lambda prediction: {"first": float(prediction.predictions.flat[0])}
    with pytest.raises(hf_rtp.SettingError, match="evaluation loss only"):
        trainer.evaluate()
    return results


def test_trainer_evaluates_as_vanilla_and_refuses_what_it_cannot_compute_on_chunks(tmp_path):
    path = make_tiny("llama", tmp_path / "llama")
    results = run_on_ranks(_trainer, 2, path, str(tmp_path / "out"))
    assert results[0] == results[1]
    for when in ("before", "after"):
        assert abs(results[0][when] - results[0][f"vanilla {when}"]) < 1e-6, results[0]
    assert abs(results[0]["between"] - results[0]["vanilla after"]) < 1e-6, results[0]  # max_steps=1: same weights
    assert abs(results[0]["before"] - results[0]["after"]) > 1e-3  # the step changed the model evaluated


def test_a_ring_of_one_runs_the_block_unchanged_and_unshard_gives_the_tensors_back(tmp_path):
    """World size 1 is plain PyTorch (I8): the block cuts nothing, and code written for N ranks runs."""
    import hf_rtp

    path = make_tiny("llama", tmp_path / "llama")
    model = hf_rtp.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa", fused_loss=False).eval()
    batch = {"input_ids": _ids()}
    with torch.no_grad(), hf_rtp.context_parallel(model, batch):
        logits = model(**batch).logits
        (whole,) = hf_rtp.context_parallel_unshard(model, [logits], [1])
    assert whole.shape == (2, SEQ, VOCAB) and torch.equal(whole, logits)
