"""accelerate: hf_rtp.Accelerator's save_state / load_state / save_model on a rotated model, against
vanilla transformers under accelerate's DDP in the same processes; a plain accelerate.Accelerator that prepares a
rotated model gets the same methods (a script changes only its model load); one that never wrapped it refuses.

The loss of each step is scaled by a random factor drawn from the global RNG, so a resume that did
not restore every rank's RNG (or the optimizer, or the scheduler) gives other losses.
"""

import functools
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _prepare(accelerator, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return accelerator.prepare(model, optimizer, scheduler)


def _steps(accelerator, model, optimizer, scheduler, steps):
    rank, world = accelerator.process_index, accelerator.num_processes
    losses = []
    for step in steps:
        batch = global_batch(world, seed=step)[rank]
        loss = model(input_ids=batch, labels=batch).loss * (1 + torch.rand(()))
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def _round_trip(ckpt, out, reference, plain=False):
    import accelerate
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    # hf_rtp's: cpu=True by default without CUDA, so a distributed launch stays distributed; plain accelerate's as
    # run_clm_no_trainer.py builds it (launched with --cpu), adopted when its prepare wraps the rotated model
    accelerator = accelerate.Accelerator(cpu=True) if plain else hf_rtp.Accelerator()
    torch.manual_seed(100 + rank)
    vanilla = _steps(
        accelerator, *_prepare(accelerator, AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)), range(4)
    )

    torch.manual_seed(100 + rank)
    model, optimizer, scheduler = _prepare(accelerator, hf_rtp.from_pretrained(ckpt, dtype=torch.float64).train())
    first = _steps(accelerator, model, optimizer, scheduler, range(2))
    accelerator.save_state(out)
    epoch = scheduler.scheduler.last_epoch
    unwrapped = accelerator.unwrap_model(model)
    saved = {f"param.{n}": _full(p) for n, p in unwrapped.named_parameters()}
    saved |= {f"exp_avg.{n}": _full(optimizer.state[p]["exp_avg"]) for n, p in unwrapped.named_parameters()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in saved.items()}, reference)
    uninterrupted = _steps(accelerator, model, optimizer, scheduler, range(2, 4))
    accelerator.load_state(out)
    resumed = _steps(accelerator, model, optimizer, scheduler, range(2, 4))

    final = os.path.join(os.path.dirname(out), "final")
    accelerator.save_model(model, final)  # collective, like accelerate's own call on every rank
    weights = {n: _full(p) for n, p in accelerator.unwrap_model(model).named_parameters()}
    accelerator.wait_for_everyone()
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64)
        assert all(torch.equal(p, weights[n]) for n, p in loaded.named_parameters())  # bit-exact in vanilla
    return vanilla, first + uninterrupted, resumed, uninterrupted, epoch


def _resume_elsewhere(ckpt, out, reference):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    accelerator = hf_rtp.Accelerator()
    _prepare(accelerator, AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64))  # as the saving script did
    model, optimizer, scheduler = _prepare(accelerator, hf_rtp.from_pretrained(ckpt, dtype=torch.float64).train())
    accelerator.load_state(out)
    expected = load_file(reference)
    unwrapped = accelerator.unwrap_model(model)
    for name, p in unwrapped.named_parameters():
        assert torch.equal(_full(p), expected[f"param.{name}"]), name
        assert torch.equal(_full(optimizer.state[p]["exp_avg"]), expected[f"exp_avg.{name}"]), name
    epoch = scheduler.scheduler.last_epoch
    return epoch, len(_steps(accelerator, model, optimizer, scheduler, range(2, 3)))


def test_save_state_load_state_round_trip_exactly_and_reshard(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    out, reference = str(tmp_path / "state"), str(tmp_path / "reference.safetensors")
    vanilla, rotated, resumed, uninterrupted, epoch = run_on_ranks(_round_trip, 2, ckpt, out, reference)[0]
    # the same training as accelerate's DDP, up to float32 rounding: the fused LM-head loss sums its
    # float32 softmax in another order than vanilla's, and AdamW (eps 1e-8) amplifies that a little
    torch.testing.assert_close(rotated, vanilla, atol=1e-5, rtol=1e-5)
    assert resumed == uninterrupted  # exactly: weights, AdamW moments, scheduler and every rank's RNG
    files = sorted(os.listdir(out))
    # accelerate still saves what it can (the vanilla model it also prepared is model 0); the rotated one is ours
    assert {"hf_rtp_state_0", "model.safetensors", "optimizer.bin"} <= set(files), files
    assert not {"model_1.safetensors", "optimizer_1.bin"} & set(files), files
    # at 3 ranks: every parameter and moment where it belongs (checked inside), the scheduler's step, and training
    # goes on
    assert run_on_ranks(_resume_elsewhere, 3, ckpt, out, reference) == [(epoch, 1)] * 3


def test_a_plain_accelerator_saves_and_resumes_a_rotated_model_as_hf_rtps_does(tmp_path):
    """run_clm_no_trainer.py's `accelerator.save_state` with `Accelerator(` left as it is: the rotated model and its
    optimizer through hf_rtp's state (refused before, with an empty step folder left behind)."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    out, reference = str(tmp_path / "state"), str(tmp_path / "reference.safetensors")
    vanilla, rotated, resumed, uninterrupted, _ = run_on_ranks(_round_trip, 2, ckpt, out, reference, True)[0]
    torch.testing.assert_close(rotated, vanilla, atol=1e-5, rtol=1e-5)
    assert resumed == uninterrupted
    assert {"hf_rtp_state_0", "model.safetensors", "optimizer.bin"} <= set(os.listdir(out))


def _plain_accelerate_refuses(ckpt, out):
    from accelerate import Accelerator

    import hf_rtp

    rank = int(os.environ["RANK"])
    accelerator = Accelerator(cpu=True)
    # the optimizer prepared, the model not (a script that runs its model itself): accelerate never wraps the model
    # in DDP, so hf_rtp never sees this Accelerator, and its own save_state would pickle rank 0's AdamW moments
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = global_batch(2)[rank]
    model(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)  # the model runs outside DDP: its loop averages the replicated gradients itself
    optimizer.step()
    outcomes = []
    for safe in (False, True):  # pickle or safetensors: either would write rank 0's rows
        try:
            accelerator.save_state(os.path.join(out, str(safe)), safe_serialization=safe)
            outcomes.append(None)
        except hf_rtp.RotatedStateError as err:
            outcomes.append(str(err))
        accelerator.wait_for_everyone()
    with pytest.raises(hf_rtp.RotatedStateError, match=r"hf_rtp.Accelerator\(\).save_model"):
        accelerator.save_model(model, os.path.join(out, "model"))  # refused on every rank

    class Mine(Accelerator):  # a user's override stays in charge: not shadowed by hf_rtp's on the instance
        def save_state(self, *args, **kwargs):
            self.called = True
            return super().save_state(*args, **kwargs)

    mine = Mine(cpu=True)
    mine.prepare(model)  # wrapped in DDP: hf_rtp adopts what Mine does not override
    try:
        mine.save_state(os.path.join(out, "mine"))
        outcomes.append(None)
    except hf_rtp.RotatedStateError as err:
        outcomes.append(str(err))
    return rank, outcomes, getattr(mine, "called", False), "save_model" in mine.__dict__


def test_plain_accelerate_that_never_wrapped_the_model_refuses_to_write_one_ranks_rows(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    found = run_on_ranks(_plain_accelerate_refuses, 2, ckpt, str(tmp_path / "state"))
    outcomes = {rank: rest for rank, *rest in found}
    for rank, (mine, called, adopted) in outcomes.items():
        assert called and adopted, rank  # Mine's save_state ran; the methods it does not override are hf_rtp's
        assert "refusing to write a rotated tensor" in mine[2], rank  # its super() is accelerate's, which refuses
    outcomes = {rank: found[0] for rank, found in outcomes.items()}
    for safe in (0, 1):  # accelerate pickles the optimizer on rank 0 only, whatever safe_serialization says
        assert "refusing to pickle a rotated tensor" in outcomes[0][safe] and "save_state" in outcomes[0][safe]
        assert outcomes[1][safe] is None  # rank 1 had nothing to refuse
    partial = tmp_path / "state" / "False" / "optimizer.bin"  # torch.save had opened it: it cannot load
    if partial.exists():
        with pytest.raises(RuntimeError, match="PytorchStreamReader failed"):  # torch.save stopped midway
            torch.load(partial, weights_only=True)


def _on_devices(ckpt, plain):
    """accelerate's multi-device prepare (MULTI_GPU's branch), reached on the CPU by an Accelerator whose
    `multi_device` reads True, with accelerate's ACCELERATE_BYPASS_DEVICE_MAP giving DDP no device ids, as a CPU
    module needs. There accelerate 1.15 refuses any model holding DTensors before it wraps DDP; on an H200 every
    launched recipe died of it (benchmarks/results/gpu-check-h200-run12.log). The GPU check's recipes stage runs the
    real branch."""
    import accelerate
    from transformers import AutoModelForCausalLM

    import hf_rtp

    os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    base = accelerate.Accelerator if plain else hf_rtp.Accelerator

    class OnDevices(base):  # type: ignore[misc, valid-type]
        @property
        def multi_device(self):
            return True

    def under(kind, fsdp2=False):  # what an fsdp_config (with cpu_offload, say) or a deepspeed_config sets on GPUs
        class Under(base):  # type: ignore[misc, valid-type]
            distributed_type = property(lambda self: kind)
            is_fsdp2 = property(lambda self: fsdp2)

        return Under(cpu=True)

    # plain: built before the load, as run_clm_no_trainer.py builds it (one built after is accelerate's to refuse)
    accelerator = OnDevices(cpu=True)
    kinds = accelerate.utils.DistributedType
    sharding = {
        "set up for FSDP": under(kinds.FSDP),  # FSDP1: accelerate's prepare_model
        "set up for FSDP (": under(kinds.FSDP, fsdp2=True),  # FSDP2: accelerate's _prepare_fsdp2, all at once
        "set up for DeepSpeed": under(kinds.DEEPSPEED),  # accelerate's _prepare_deepspeed
    }
    rank, world = accelerator.process_index, accelerator.num_processes
    batch = global_batch(world, seed=3)[rank]
    grads = []
    # the fused loss sums its softmax in float32: off, so float64 compares to rounding
    for load in (AutoModelForCausalLM.from_pretrained, functools.partial(hf_rtp.from_pretrained, fused_loss=False)):
        model = accelerator.prepare(load(ckpt, dtype=torch.float64).train())
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        unwrapped = accelerator.unwrap_model(model)
        grads.append({n: _full(p.grad) for n, p in unwrapped.named_parameters()})
        # the DDP wrapper is marked as prepared, not the model, as accelerate's own training prepare leaves them
        assert getattr(model, "_is_accelerate_prepared", False) and "_is_accelerate_prepared" not in unwrapped.__dict__
    vanilla, rotated = grads
    assert vanilla.keys() == rotated.keys()

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64).train()
    optimizer = torch.optim.AdamW(model.parameters())
    for expected, other in sharding.items():
        with pytest.raises(hf_rtp.IntegrationError) as refused:
            other.prepare(model, optimizer)
        assert expected in str(refused.value) and "hf_rtp.CPUOffloadOptimizer" in str(refused.value), refused.value
    assert "ZeRO-Offload" in str(refused.value)
    return {n: (rotated[n] - vanilla[n]).abs().max().item() / vanilla[n].abs().max().item() for n in vanilla}


@pytest.mark.parametrize("plain", [False, True], ids=["hf_rtp-accelerator", "plain-accelerator"])
def test_accelerates_multi_device_prepare_wraps_a_rotated_model_in_ddp(tmp_path, plain):
    """... and one set up for FSDP (its cpu_offload), FSDP2 or DeepSpeed (ZeRO-Offload) refuses the rotated model by
    name, naming CPUOffloadOptimizer."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for gaps in run_on_ranks(_on_devices, 2, ckpt, plain):
        # every gradient DDP's, averaged over both ranks' batches, before any optimizer (float64: to rounding)
        assert max(gaps.values()) < 1e-10, gaps
