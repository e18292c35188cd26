"""The code users copy from the docs, run exactly as written at 2 ranks, beside vanilla transformers in the same
processes: README.md's "The one-line change", then docs/context-parallel.md's plain loop and its
`context_parallel_unshard` block on the same model and optimizer (a script that goes on from the first: train mode,
labels given), then its accelerate block, whole. The only change to a block's text is the checkpoint's placeholder,
replaced by a tiny local checkpoint; the user's data (`my_batch`; `ids` and `labels`; `dataset`) is given to it.

The blocks load in float32, as written, so losses, logits and the weights after each AdamW step are compared at
float32's rounding: a step that differs from vanilla's is off by about its whole size (lr), which the weights'
tolerance (a tenth of lr) does not admit. A block that stops running, or whose comments stop saying what happens
(`out.logits is None` in training), fails here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from support.compare import assert_matches
from support.models import VOCAB, global_batch, make_tiny
from support.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = '"path/or/hub-id"'
BLOCKS = {  # name -> (file, the text just before its first python block)
    "readme": ("README.md", "## The one-line change"),
    "loop": ("docs/context-parallel.md", "**A plain torchrun loop:**"),
    "unshard": ("docs/context-parallel.md", "**What a forward in the block returns.**"),
    "accelerate": ("docs/context-parallel.md", "**accelerate**"),
}
LR = 1e-4  # the blocks' AdamW
WEIGHTS_ATOL = LR / 10  # float32 gradients move a first Adam step only where they are near Adam's eps
SEQ = 11  # 4 chunks of 3, 3, 3 and 2 tokens at 2 ranks


def python_block(file: str, marker: str) -> str:
    """The first ```python block after `marker`, which the file holds once."""
    text = (ROOT / file).read_text()
    assert text.count(marker) == 1, (file, marker)
    found = re.compile(r"```python\n(.*?)```", re.S).search(text, text.index(marker))
    assert found is not None, (file, marker)
    return found.group(1)


def _with_checkpoint(code: str, ckpt: str) -> str:
    return code.replace(PLACEHOLDER, repr(ckpt))


def _sequence(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:3] = -100  # a prompt
    return ids, labels


def _vanilla(ckpt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").train()
    return ref, torch.optim.AdamW(ref.parameters(), lr=LR)


def _gap(model, ref, world, rank) -> float:
    """The largest difference between this rank's weights and vanilla's (rotated ones as its rows)."""
    from support.compare import rows
    from torch.distributed.tensor import DTensor

    theirs = dict(ref.named_parameters())
    gaps = []
    for name, p in model.named_parameters():
        mine, want = (p.to_local(), theirs[name][rows(p, world, rank)]) if isinstance(p, DTensor) else (p, theirs[name])
        gaps.append((mine - want).abs().max().item())
    return max(gaps)


def _blocks(ckpt: str, workdir: str, blocks: dict[str, str]) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.chdir(workdir)  # the README's block saves to "out"
    gaps = {}

    # README: each rank its own batch; vanilla's step on the mean of the ranks' losses (DDP's), clipped alike
    batches = global_batch(world)
    script = {"my_batch": batches[rank]}
    exec(_with_checkpoint(blocks["readme"], ckpt), script)
    model, out = script["model"], script["out"]
    assert model.training and out.logits is None, (model.training, out.logits)  # what its comments say
    ref, ref_optimizer = _vanilla(ckpt)
    ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
    torch.testing.assert_close(out.loss, ref_losses[rank], atol=1e-6, rtol=1e-5)
    torch.stack(ref_losses).mean().backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_optimizer.step()
    gaps["readme"] = _gap(model, ref, world, rank)
    assert_matches(model, ref, world, rank, "param", atol=WEIGHTS_ATOL, rtol=0)
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.state_dict().items()}
    if rank == 0:  # what it saved is the trained model, which vanilla loads
        saved = AutoModelForCausalLM.from_pretrained("out", dtype=torch.float32).state_dict()
        assert saved.keys() == whole.keys() and all(torch.equal(saved[n], whole[n]) for n in saved)
    dist.barrier()

    # context-parallel.md's plain loop, then its unshard block, on the same model and optimizer: one sequence, the
    # same on every rank, against vanilla's step on it
    script["optimizer"].zero_grad()  # a new step: the README's block leaves its gradients
    ref_optimizer.zero_grad()
    ids, labels = (t[None] for t in _sequence(seed=5))
    script.update(ids=ids, labels=labels)
    exec(blocks["loop"], script)
    ref(input_ids=ids, labels=labels).loss.backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    gaps["loop"] = _gap(model, ref, world, rank)
    assert_matches(model, ref, world, rank, "param", atol=WEIGHTS_ATOL, rtol=0)
    exec(blocks["unshard"], script)  # in train mode, its batch's labels given
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=labels).logits
    assert script["whole"].shape == (1, SEQ, VOCAB)
    torch.testing.assert_close(script["whole"], expected, atol=1e-5, rtol=1e-5)

    # the accelerate block, whole: a model of its own, two steps, one sequence each, the same on both ranks
    dataset = [dict(zip(("input_ids", "labels"), _sequence(seed=s), strict=True)) for s in (6, 7)]
    script = {"dataset": dataset}
    exec(_with_checkpoint(blocks["accelerate"], ckpt), script)
    ref, ref_optimizer = _vanilla(ckpt)
    for item in dataset:
        ref_loss = ref(input_ids=item["input_ids"][None], labels=item["labels"][None]).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    torch.testing.assert_close(script["loss"], ref_loss, atol=1e-6, rtol=1e-5)
    trained = script["accelerator"].unwrap_model(script["model"])
    assert trained.training
    gaps["accelerate"] = _gap(trained, ref, world, rank)
    assert_matches(trained, ref, world, rank, "param", atol=WEIGHTS_ATOL, rtol=0)
    return gaps


def test_the_docs_blocks_run_as_written_and_train_as_vanilla(tmp_path):
    blocks = {name: python_block(*where) for name, where in BLOCKS.items()}
    assert all(PLACEHOLDER in blocks[name] for name in ("readme", "accelerate"))
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    workdir = tmp_path / "script"
    workdir.mkdir()
    gaps = run_on_ranks(_blocks, 2, ckpt, str(workdir), blocks)
    assert (workdir / "out" / "config.json").is_file()
    assert all(set(g) == {"readme", "loop", "accelerate"} for g in gaps), gaps  # each rank ran every block
