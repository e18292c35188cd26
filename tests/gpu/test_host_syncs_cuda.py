"""A training step on CUDA that the host can run ahead of: no synchronising op in hf_rtp's code (issue 66).

tests/distributed/test_host_syncs.py counts on the CPU the ops that would wait for a CUDA device; a CPU cannot show
the waits only a GPU makes: a copy to the host (`.cpu()`, `.tolist()` of a device tensor) or from pageable host
memory (`torch.tensor(list, device=...)`), and whatever runs inside torch's C++. Here torch itself reports each one
(`torch.cuda.set_sync_debug_mode("warn")`, a warning per wait, counted at the innermost frame outside torch: hf_rtp's
or elsewhere), during the whole step as users run it: forward with labels (a masked prompt: the fused loss takes
the labelled tokens by a count copied at the forward's start, no wait), backward, sync_grads, clip_grad_norm_ and
AdamW as torch picks it on CUDA (foreach). A rotated Llama with its embedding and head rotated, weights moving and
tokens moving, at two ranks on cuda:0 over NCCL, beside vanilla transformers under DDP on the same batch: hf_rtp's
code makes none but at ALLOWED, and elsewhere (transformers, torch's optimizer) no more than vanilla's step.

Only in the NCCL world (gpu_world.py): in the gloo world the ring stages each hop through host memory, a wait per
hop by design (docs/reliability.md). The first step of each model runs unwatched: what a model does once in its
life (replicated copies compared at the first sync_grads, NCCL's communicators made) is not a step's cost.
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings

import pytest
import torch
from gpu_world import NCCL_WORLD, NO_CUDA, join_world
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks
from support.user_step import user_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.timeout(100),
]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "hf_rtp") + os.sep
_WARNINGS = warnings.__file__

# where hf_rtp's code may wait for the device in a step, with why; the most waits per phase
ALLOWED = {
    "layers/embedding.py __init__": (
        1,
        "tokens x pieces > _FEW only (not at this size): the embedding's tokens sorted by id, their positions at the "
        "pieces' boundaries read in one transfer, where looking every token up in every piece would cost more",
    ),
}


class Syncs:
    """torch's sync debug mode, each warning it raises counted by (phase, place); `phase` is set by the caller."""

    def __init__(self):
        self.phase = "step"
        self.counts: collections.Counter = collections.Counter()
        self._caught = warnings.catch_warnings()

    def __enter__(self):
        self._caught.__enter__()  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return self._caught.__exit__(*exc)

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            self.counts[self.phase, _place()] += 1


def _place() -> str:
    """'model/forward.py loss' for a wait hf_rtp's code made; 'elsewhere' for one whose innermost frame outside torch
    (and the warnings machinery) is not hf_rtp's."""
    for frame in reversed(traceback.extract_stack()):
        ours = frame.filename == __file__ and frame.name in ("_show", "_place")
        if frame.filename.startswith(_TORCH) or frame.filename == _WARNINGS or ours:
            continue
        if frame.filename.startswith(_PACKAGE):
            return f"{frame.filename[len(_PACKAGE) :]} {frame.name}"
        return "elsewhere"
    return "elsewhere"


def _watched_steps(ckpt):
    """Each model's second step under torch's sync debug mode: {name: {(phase, place): waits}}, and how many token
    walks each rotated model's watched step made."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    device = join_world()
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch(world)[rank].to(device)
    labels = batch.clone()
    labels[:, :3] = -100  # a prompt without labels
    models = {
        moves: hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device, rotation_moves=moves).train()
        for moves in ("weights", "activations")
    }
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).train()
    vanilla = DistributedDataParallel(ref, device_ids=[device.index])
    found, walks = {}, {}
    for name, model in (("vanilla", vanilla), *models.items()):
        rotated = name != "vanilla"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # foreach: torch's pick for CUDA tensors
        user_step(model, batch, labels, optimizer, rotated, None)  # once in a model's life: unwatched
        torch.cuda.synchronize()
        ring = hf_rtp.state_of(model).topology.ring if rotated else None
        before = ring.token_walks if ring is not None else 0
        with Syncs() as syncs:
            user_step(model, batch, labels, optimizer, rotated, syncs)
        torch.cuda.synchronize()
        found[name] = dict(syncs.counts)
        walks[name] = ring.token_walks - before if ring is not None else 0
    return found, walks


def test_a_whole_training_step_on_cuda_waits_for_the_device_no_more_than_vanilla_ddps(tmp_path):
    if os.environ.get("HF_RTP_TEST_BACKEND") != NCCL_WORLD:
        pytest.skip("the NCCL world only: the gloo world's ring stages each hop through host memory, a wait a hop")
    ckpt = make_tiny("llama", tmp_path / "ckpt", vocab_size=1009)  # the head's tokens fit a slot: they move too
    for rank, (found, walks) in enumerate(run_on_ranks(_watched_steps, 2, ckpt, fresh=True)):
        assert walks["weights"] == 0 < walks["activations"], (rank, walks)  # both ways walked
        vanilla = found["vanilla"]
        for name in ("weights", "activations"):
            for (phase, place), n in found[name].items():
                if place == "elsewhere":
                    assert n <= vanilla.get((phase, place), 0), (rank, name, phase, n, vanilla)
                    continue
                rule = next((r for prefix, r in ALLOWED.items() if place.startswith(prefix)), None)
                assert rule is not None and n <= rule[0], (rank, name, phase, place, n, found[name])
