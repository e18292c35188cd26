"""The GPU check's users' paths (.ci/gpu's users-loop, recipes and trl stages), run here as they run there but on the
CPU over gloo at a tiny shape: tests/gpu/users_loop.py's torchrun loop, where hf_rtp starts the world itself, and
tests/gpu/users_recipes.py's `accelerate launch` pairs of recipes/finetune.py, recipes/trainer_sft.py and TRL's sft.py,
each beside plain transformers and DDP. On a GPU only the device, the backend and the dtypes differ.

The loop's bf16 variants still fail their comparison, on the CPU, for causes of their own that are not the ring's
sum over chunks (fixed: layers/linear.py's `walk_backward` and the fused loss now sum an input's gradient over the
ring's chunks in float32 and round once, as vanilla's one matmul does; tests/distributed/test_bf16_accumulation.py
compares that with vanilla at 2 and 3 ranks, untiled):
- bf16 and autocast tile the MLP (`tiled_mlp`): each tile's weight gradient is rounded to bf16 on its own
  (model/tiled_mlp.py), where vanilla's one matmul over all of a rank's tokens rounds once; the MLP's weights are
  2e-3 from vanilla's (relative L2) against a CPU floor of 6e-6 (autocast), and bf16's norms, tiled too, 5e-3
  against 1e-3. Untiled, both variants hold (autocast 9e-6, bf16 1.4e-3, within their tolerances);
lora-bf16 (no tiled MLP) holds: its first gradients are vanilla's (gap 0), and its losses over 20 steps are within
4.8e-5 of vanilla's, against vanilla's own 1.5e-5 (tolerance 6e-5). That residue is real and not the ring's sum:
once a step makes LoRA's B nonzero the adapters add input gradients too, and a stacked walk of q/k/v or gate/up
(layers/stacked.py) hands autograd its members' sum at once, where vanilla's autograd adds each base gradient beside
its adapter's: the same bf16 terms in another order (at 3 steps the loss is 1.1e-5 off, against a floor of 1e-7;
with STACKED empty the loop follows vanilla to 1e-7 for 6 steps).
autocast-untiled (the MLPs whole, offload off) isolates the ring's sums under autocast: its first gradients hold
(within 4 x vanilla's floor), but over 20 AdamW steps its losses leave the floor's tolerance at step 12 (2.6e-5
against 2.2e-5), not traced yet (the stacked walk's order of adds is the first suspect, as for lora-bf16).
The variants that fail are strict xfails: they fail CI the day that is fixed, so that this note goes with it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
KNOWN = {
    "bf16": "known: tiled_mlp rounds each tile's weight gradient to bf16, vanilla's one matmul once",
    "autocast": "known: tiled_mlp rounds each tile's weight gradient to bf16, vanilla's one matmul once",
    # untiled, its first gradients hold (within the floor); its losses drift past it by step 12 of 20 (2.6e-5
    # against 2.2e-5): not traced yet, see the module's docstring
    "autocast-untiled": "known: losses drift past the floor after ~12 AdamW steps; the first gradients hold",
}


def _run(script, *args, timeout=1500):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", script), *args],
        env=ENV,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
    )
    return done


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    out = tmp_path_factory.mktemp("users-loop")
    done = _run("users_loop.py", "--device", "cpu", "--out", str(out))
    assert done.returncode in (0, 1), f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"  # 1: comparisons failed
    with open(out / "users-loop.json") as f:
        return json.load(f), done.stdout


def _failures(loop, variant):
    return [f for f in loop[0]["failures"] if f", {variant}:" in f]


def test_hf_rtp_starts_the_world_and_a_float32_loop_with_every_feature_is_vanillas(loop):
    result, stdout = loop
    assert _failures(loop, "float32") == [], _failures(loop, "float32")
    for rank in result["ranks"]:
        assert rank["world_started_before_hf_rtp"] is False and rank["backend"] == "gloo"
        v = rank["variants"]["float32"]
        assert v["tiled"] == 2 and v["checkpointing"] and v["rotated"] > 0 and v["compared"] == 21
        assert len(v["losses"]["rtp"]) == 20 and len(set(v["losses"]["rtp"])) == 20  # a new batch each step
        assert max(v["grad_gaps"].values()) < 1e-5  # float32 rounding of another order, not a fault
    assert "float32" in stdout and "world started by hf_rtp: gloo" in stdout


def test_generate_greedy_and_sampled_gives_vanillas_tokens_on_every_rank(loop):
    result, _ = loop
    assert not [f for f in result["failures"] if "generate" in f]
    tokens = [rank["generate"]["sampled"]["rtp"] for rank in result["ranks"]]
    assert tokens[0] != tokens[1]  # each rank its own prompts and seed


def test_the_loop_can_fail_bf16_accumulation_is_out_of_its_tolerance(loop):
    spec = importlib.util.spec_from_file_location("noise_floor", os.path.join(ROOT, "tests", "gpu", "noise_floor.py"))
    noise_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noise_floor)
    tolerance = noise_floor.tolerance
    for rank in loop[0]["ranks"]:
        for name in ("autocast", "lora-bf16"):  # where vanilla's gradients are float32
            v = rank["variants"][name]
            assert max(v["bf16"].values()) > tolerance(v["floor"]), (name, v["bf16"], v["floor"])


@pytest.mark.parametrize(
    "variant",
    [
        *(pytest.param(v, marks=pytest.mark.xfail(strict=True, reason=why)) for v, why in KNOWN.items()),
        "lora-bf16",
    ],
)
def test_bf16_variants_match_vanilla_within_its_noise_floor(loop, variant):
    assert _failures(loop, variant) == []


def test_untiled_autocast_first_gradients_are_vanillas_within_the_floor(loop):
    """The ring's sums alone under autocast, before any optimizer: every gradient within the floor's tolerance (the
    failures the loop names for this variant are its later losses only)."""
    assert _failures(loop, "autocast-untiled")  # the losses' drift above: when it goes, so does this xfail's note
    assert not [f for f in _failures(loop, "autocast-untiled") if "gradient" in f]


# CI's 15 minutes on 2 cores: the plain-loop recipe here; the Trainer recipe and TRL's script launched beside vanilla
# run in the GPU check (users_recipes.py), and on the CPU through test_recipe_with_trainer_and_qlora.py and
# test_trl_sft_script.py
@pytest.mark.parametrize("recipe", ["finetune"])
def test_a_launched_recipe_trains_saves_and_loads_as_on_plain_transformers(tmp_path, recipe):
    if recipe == "trl":
        pytest.importorskip("trl")
    done = _run("users_recipes.py", "--device", "cpu", "--only", recipe, "--out", str(tmp_path))
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    with open(tmp_path / "users-recipes.json") as f:
        result = json.load(f)
    measured = result["measured"][recipe]
    assert result["failures"] == [] and measured["largest loss gap"] < 1e-5, measured
    assert measured["largest grad_norm gap"] < 1e-5
    with open(tmp_path / f"{recipe}-rtp.log", errors="replace") as f:
        log = f.read()
    if recipe == "finetune":
        assert "2 rank(s): 1 replica(s) of a 2-rank ring" in log  # launched, distributed, rotated
