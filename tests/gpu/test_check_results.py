"""What .ci/gpu's long-step and bench stages assert (benchmarks/long_step_cuda.py's `claims`, bench_claims.py),
read on the GPU results stored from earlier calls, on any machine: the runs that passed hold every claim, and the
same results changed where a claim would catch a fault fail it."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from bench_claims import claims as bench_claims
from bench_claims import main as bench_main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _long_step():
    spec = importlib.util.spec_from_file_location("long_step_cuda", ROOT / "benchmarks" / "long_step_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(name):
    return json.loads((RESULTS / name).read_text())


@pytest.mark.parametrize("run", ["long-step-h100-run8.json", "long-step-h100-run11.json"])
def test_the_stored_long_step_runs_hold_every_claim(run):
    stored = _read(run)
    held, failed = _long_step().claims(stored["meta"], stored["rows"])
    assert failed == [] and len(held) == 10, (held, failed)


def test_long_step_claims_fail_where_a_mechanism_would_be_broken():
    claims = _long_step().claims
    stored = _read("long-step-h100-run11.json")

    def changed(variant, **values):
        rows = copy.deepcopy(stored["rows"])
        next(r for r in rows if r["variant"] == variant).update(values)
        return claims(stored["meta"], rows)[1]

    (failure,) = changed("offload (hf_rtp)", held_gb=2.5)  # the inputs stayed on the GPU
    assert failure.startswith("offload (hf_rtp): frees 0.202 GB")
    (failure,) = changed("offload (hf_rtp)", gap=0.05)  # a copy that changed values
    assert failure.startswith("offload (hf_rtp): gradient gap 5.00e-02")
    assert changed("tiled", peak_gb=6.0)[0].startswith("tiled: peak 6.000 GB")  # tiles that saved nothing
    assert changed("tiled", gap=0.1) == ["tiled: gradient gap 1.00e-01, allowed 2.48e-02"]
    # a device whose plain runs agree exactly holds offload to exactly (its copies change no value), tiling to 2^-6
    # of the largest entry (1.56e-2: run 11's tiled 1.46e-2 and 1.10e-2 still pass)
    assert [f.split(":")[0] for f in changed("checkpointing, again", gap=0.0)] == [
        "offload (transformers)",
        "offload (hf_rtp)",
    ]
    # the older file has no floor to read gaps against: it cannot pass
    older = _read("long-step-h100.json")
    assert claims(older["meta"], older["rows"])[1] == [
        "no second plain checkpointing run: no run-to-run floor to read the gaps against"
    ]


@pytest.mark.parametrize(
    "run", ["gpu-check-h100-run5-bench.json", "gpu-check-h100-run8-nccl-bench.json", "gpu-check-h100-run11-bench.json"]
)
def test_the_stored_bench_runs_hold_every_claim(run, capsys):
    assert bench_main([str(RESULTS / run)]) == 0
    out = capsys.readouterr().out
    assert out.count("holds:") == 4 and "RTP's peak" in out, out


def test_bench_claims_fail_on_a_failed_strategy_other_losses_or_more_memory():
    stored = _read("gpu-check-h100-run11-bench.json")
    assert bench_claims(_read("gpu-check-h100-run1-bench.json"))[1][0] == "strategies failed: [('rtp', 2)]"
    other = copy.deepcopy(stored)
    other["results"][2]["ranks"][1]["losses"][0] += 0.01  # rtp's rank 1 trained on other data
    (failure,) = bench_claims(other)[1]
    assert failure.startswith("rtp: first losses")
    heavier = copy.deepcopy(stored)
    heavier["results"][2]["peak_gb"] = 2.6
    (failure,) = bench_claims(heavier)[1]
    assert failure.startswith("RTP's peak 2.600 GB per rank against DDP's 2.507 GB")
    assert "DDP and RTP must both run" in bench_claims(_read("gpu-check-h100-run4-bench-rtp.json"))[1][0]
