"""How far hf_rtp may be from vanilla, set by how far vanilla is from itself (the GPU check's users' loop,
tests/gpu/users_loop.py; docs/testing.md, "On a GPU").

A fixed tolerance ("3e-2 of the largest entry under bf16") is wide enough for any bf16 rounding, so it also lets
through gradients accumulated in bf16 where vanilla sums in float32 (about 4e-3 of the largest entry): the check
could not fail for that bug. Here the tolerance comes from a measured noise floor instead:

- the floor is vanilla against vanilla with another reduction order: the same DDP step with each rank's batch in
  reversed order, so every weight gradient's sum over tokens runs in another order (a ring's sum over ranks is
  such a reordering too), and nothing else changes: each token's forward is the same;
- a gap is a parameter's relative L2 distance, ||mine - vanilla|| / ||vanilla||, in float64. The max-entry measure
  of the old tests reads one flipped bf16 rounding of a large entry (2^-8 of it) as large as a bf16 sum over every
  entry; the L2 distance tells sparse flips (a reordering's) from dense rounding (bf16 accumulation's, which moves
  nearly every entry by up to half a bf16 unit: about 1e-3 relative);
- the tolerance is FACTOR times the largest gap of the floor, or LEAST where the floor is smaller (kernels that
  happen to give equal sums in both orders): LEAST sits between float32's rounding (1e-7) and bf16's (1e-3);
- the check proves it can fail: `bf16_accumulated` sums vanilla's per-rank gradients in bf16, and that sum must be
  out of tolerance wherever vanilla's gradients are float32 (fp32 weights under autocast, LoRA adapters). With bf16
  weights vanilla's DDP sums in bf16 itself, and there is nothing to tell apart.

Loss trajectories over AdamW steps compare the same way: hf_rtp's step-by-step gap to vanilla within FACTOR times
vanilla's own gap to the reordered vanilla (or LEAST_LOSS).

Plain functions over dicts of tensors and lists of floats, checked on any machine (test_noise_floor.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

FACTOR = 4.0
"""how many times vanilla's own gap hf_rtp's may be"""
LEAST = 2e-5
"""the smallest tolerance of a gradient's relative L2 gap: above float32 rounding, below bf16's"""
LEAST_LOSS = 1e-5
"""the smallest tolerance of a loss's relative gap, for trajectories whose floor is smaller"""


def relative_gap(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """||mine - reference|| / ||reference|| in float64; 0.0 where both are zero, inf where only the reference is."""
    mine, reference = mine.detach().double(), reference.detach().double()
    scale = reference.norm().item()
    gap = (mine - reference).norm().item()
    if scale == 0.0:
        return 0.0 if gap == 0.0 else float("inf")
    return gap / scale


def gaps(mine: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """relative_gap per name; the two must hold the same names."""
    if set(mine) != set(reference):
        raise KeyError(f"different parameters: {sorted(set(mine) ^ set(reference))}")
    return {name: relative_gap(mine[name], reference[name]) for name in reference}


def tolerance(floor: Mapping[str, float] | Iterable[float], factor: float = FACTOR, least: float = LEAST) -> float:
    """FACTOR times the largest gap of the floor, or `least`."""
    values = list(floor.values()) if isinstance(floor, Mapping) else list(floor)
    return max(factor * max(values, default=0.0), least)


def bf16_accumulated(per_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean over ranks of each gradient, summed as a bf16 accumulator sums (each partial sum rounded to bf16),
    returned in float32: what a ring or a reduction that accumulates in bf16 gives where vanilla sums in float32."""
    total: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        for name, g in grads.items():
            g = g.detach().to(torch.bfloat16)
            total[name] = g if name not in total else (total[name] + g).to(torch.bfloat16)
    return {name: t.float() / len(per_rank) for name, t in total.items()}


def loss_gaps(mine: Sequence[float], reference: Sequence[float]) -> list[float]:
    """|mine - reference| / |reference| step by step; the two must be as long."""
    if len(mine) != len(reference):
        raise ValueError(f"{len(mine)} losses against {len(reference)}")
    return [abs(a - b) / abs(b) if b else abs(a) for a, b in zip(mine, reference, strict=True)]


def judge_gradients(
    mine: Mapping[str, float], floor: Mapping[str, float], bf16: Mapping[str, float] | None = None
) -> list[str]:
    """What is wrong, as sentences (none: within the floor's tolerance, and where `bf16` is given, that bf16
    accumulation would have failed it). `mine`, `floor` and `bf16` are gaps to vanilla by parameter."""
    limit = tolerance(floor)
    failures = [
        f"{name}: gradient {gap:.3g} from vanilla's, over {limit:.3g} ({FACTOR:g} x vanilla's own floor "
        f"{max(floor.values(), default=0.0):.3g}, least {LEAST:g})"
        for name, gap in mine.items()
        if not gap <= limit
    ]
    if bf16 is not None:
        worst = max(bf16.values(), default=0.0)
        if not worst > limit:
            failures.append(
                f"the check cannot fail: gradients accumulated in bf16 are at most {worst:.3g} from vanilla's, "
                f"within the tolerance {limit:.3g} (this device's floor is too high to tell them apart)"
            )
    return failures


def judge_losses(mine: Sequence[float], reference: Sequence[float], floor: Sequence[float]) -> list[str]:
    """What is wrong with a trajectory of losses: `mine` against vanilla's `reference`, within FACTOR times the
    largest gap of vanilla's own reordered run (`floor`, its losses) to `reference`, or LEAST_LOSS."""
    own = loss_gaps(floor, reference)
    limit = tolerance(own, least=LEAST_LOSS)
    return [
        f"step {step}: loss {a:.6g} against vanilla's {b:.6g} (gap {gap:.3g}, over {limit:.3g}: {FACTOR:g} x "
        f"vanilla's own {max(own):.3g}, least {LEAST_LOSS:g})"
        for step, (a, b, gap) in enumerate(zip(mine, reference, loss_gaps(mine, reference), strict=True), start=1)
        if not gap <= limit
    ]
