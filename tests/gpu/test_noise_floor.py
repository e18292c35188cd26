"""The GPU check's tolerance from a measured noise floor (noise_floor.py), on the CPU: vanilla against vanilla with
another reduction order passes it, gradients accumulated in bf16 where vanilla sums in float32 fail it, and so does
a gradient off by a real fault. The gradients are a real bf16-autocast backward of a tiny Llama, two ranks' batches
in one process (DDP's mean in float32, as vanilla's all-reduce makes it)."""

import pytest
import torch
from noise_floor import (
    LEAST,
    LEAST_LOSS,
    bf16_accumulated,
    gaps,
    judge_gradients,
    judge_losses,
    relative_gap,
    tolerance,
)
from support.models import global_batch, tiny_config


def _grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=batch, labels=batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def autocast_grads():
    """(each rank's gradients, DDP's mean, the mean with every batch reversed): fp32 weights, bf16 autocast."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=64, intermediate_size=128))
    batches = global_batch(2, batch=4, seq=16)
    per_rank = [_grads(model, b) for b in batches]
    reordered = [_grads(model, b.flip(0)) for b in batches]
    mean = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}
    other = {n: (reordered[0][n] + reordered[1][n]) / 2 for n in reordered[0]}
    return per_rank, mean, other


def test_a_gap_is_the_relative_l2_distance():
    ref = torch.tensor([3.0, 4.0])
    assert relative_gap(torch.tensor([3.0, 4.0]), ref) == 0.0
    assert relative_gap(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert relative_gap(torch.zeros(2), torch.zeros(2)) == 0.0  # a LoRA A at its first step: both zero
    assert relative_gap(torch.ones(2), torch.zeros(2)) == float("inf")
    with pytest.raises(KeyError, match="different parameters"):
        gaps({"a": ref}, {"b": ref})


def test_the_tolerance_is_a_multiple_of_the_floor_or_the_least():
    assert tolerance({"a": 1e-4, "b": 3e-4}) == pytest.approx(1.2e-3)
    assert tolerance({"a": 0.0}) == LEAST
    assert tolerance([]) == LEAST


def test_vanilla_reordered_passes_and_bf16_accumulation_fails(autocast_grads):
    per_rank, mean, other = autocast_grads
    floor = gaps(other, mean)
    assert max(floor.values()) < 1e-3, floor  # sparse roundings, not a bf16 sum
    # the reordered vanilla, against the floor of another reordering of itself: within
    assert judge_gradients(floor, floor) == []
    bf16 = gaps(bf16_accumulated(per_rank), mean)
    # every gradient a bf16 matmul makes is off by a bf16 rounding of its sum: dense, about 1e-3 relative
    assert min(bf16.values()) > 5e-4 and max(bf16.values()) > tolerance(floor), (bf16, tolerance(floor))
    failures = judge_gradients(bf16, floor, bf16)
    assert len(failures) >= len(bf16) // 2 and all("from vanilla's" in f for f in failures), failures
    # where the bf16 sum would pass, the check says it cannot tell, and fails
    assert any("cannot fail" in f for f in judge_gradients(floor, {n: 1.0 for n in floor}, bf16))


def test_a_gradient_off_by_a_real_fault_fails(autocast_grads):
    _, mean, other = autocast_grads
    floor = gaps(other, mean)
    one_rank_only = {n: 2 * g for n, g in mean.items()}  # a sum over ranks left undivided
    assert len(judge_gradients(gaps(one_rank_only, mean), floor)) == len(mean)
    wrong_rows = dict(mean, **{"model.embed_tokens.weight": mean["model.embed_tokens.weight"].roll(1, 0)})
    (failure,) = judge_gradients(gaps(wrong_rows, mean), floor)
    assert failure.startswith("model.embed_tokens.weight: gradient")


def test_loss_trajectories_are_judged_against_vanillas_own_spread():
    reference = [4.0, 3.5, 3.0, 2.5]
    floor = [4.0, 3.5001, 3.0, 2.5002]  # vanilla reordered: at most 8e-5 off
    assert judge_losses([4.0, 3.5003, 2.9998, 2.5004], reference, floor) == []
    (failure,) = judge_losses([4.0, 3.5, 3.0, 2.51], reference, floor)
    assert failure.startswith("step 4: loss 2.51")
    # a floor of zero leaves LEAST_LOSS
    assert judge_losses([4.0 * (1 + LEAST_LOSS / 2)], [4.0], [4.0]) == []
    assert len(judge_losses([4.0 * (1 + 2 * LEAST_LOSS)], [4.0], [4.0])) == 1
    with pytest.raises(ValueError):
        judge_losses([1.0], [1.0, 2.0], [1.0, 2.0])
