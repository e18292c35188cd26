""".ci/gpu-speed's pure parts, here: the summary's ratios and goals (benchmarks/gpu_speed.py), the file names it
takes from the device, the 1B preset's size, and FSDP2's explicit prefetch order in the bench's worker."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "gpu_speed.py")


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("gpu_speed", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(strategy: str, tokens_per_s: float, peaks_gb: list[float]) -> dict:
    """A bench row as run.py writes it: the worst rank's peak, each rank's own (in bytes, ranks out of order)."""
    ranks = [{"rank": r, "peak": gb * 1e9} for r, gb in enumerate(peaks_gb)][::-1]
    return {"strategy": strategy, "tokens_per_s": tokens_per_s, "step_s": 1.0, "peak_gb": max(peaks_gb), "ranks": ranks}


def _bench(*rows: dict) -> dict:
    settings = {"preset": "llama-1b", "checkpoint": None, "world_sizes": "2", "device": "cuda:0", "warmup": 2}
    return {"settings": settings, "model": {"parameters": 1_235_814_400}, "results": list(rows), "failed": []}


@pytest.mark.parametrize(
    "name, slug",
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"), ("x86_64", "x86-64"), ("", "device")],
)
def test_files_are_named_after_the_device_without_the_vendor(speed, name, slug):
    assert speed.device_slug(name) == slug


def test_ratios_are_rtp_over_each_other_strategy_and_goals_hold_at_their_bounds(speed):
    bench = _bench(_row("rtp", 900, [9.0, 8.0]), _row("fsdp2", 1000, [10.0, 9.5]), _row("ddp", 2000, [20.0, 18.0]))
    found = speed.ratios(bench)
    assert found["fsdp2"] == pytest.approx({"tokens_per_s": 0.9, "peak": 0.9})
    assert found["ddp"] == pytest.approx({"tokens_per_s": 0.45, "peak": 0.45})
    goals = speed.goals(found)
    assert goals["tokens_per_s"]["met"] is True and goals["peak"]["met"] is True  # 0.9x is within both goals


def test_a_slower_or_larger_rtp_misses_the_goals(speed):
    found = speed.ratios(_bench(_row("rtp", 899, [9.1, 9.0]), _row("fsdp2", 1000, [10.0, 10.0])))
    goals = speed.goals(found)
    assert goals["tokens_per_s"]["met"] is False and goals["peak"]["met"] is False
    assert goals["peak"]["ratio"] == pytest.approx(0.91)
    assert set(found) == {"fsdp2"}  # no DDP row, no DDP ratio


def test_without_fsdp2_the_goals_are_not_measured_rather_than_missed(speed):
    goals = speed.goals(speed.ratios(_bench(_row("rtp", 900, [9.0]), _row("ddp", 2000, [20.0]))))
    assert goals["tokens_per_s"]["met"] is None and goals["peak"]["ratio"] is None
    assert speed.ratios(_bench(_row("fsdp2", 1000, [10.0]))) == {}  # no RTP: nothing to compare
    offload = speed.offload(_bench(_row("rtp", 900, [9.0])))  # no rtp-offload: said so, not a failure
    assert offload["not_run"] == ["rtp-offload"] and offload["step_time"] is None and offload["saved_gb"] is None
    assert speed.goals({}, offload)["offload_step_time"]["met"] is None
    summary = speed.summarize(_bench(_row("rtp", 900, [9.0])), None, False, "")
    assert "rtp-offload/rtp: not measured (rtp-offload did not run)" in speed.lines(summary)


def test_peaks_are_listed_rank_by_rank(speed):
    assert speed.rank_peaks_gb(_row("rtp", 1, [3.0, 2.0, 1.0])) == pytest.approx([3.0, 2.0, 1.0])


def test_a_watched_hop_meets_its_goal_at_50_us_of_host_time(speed):
    hops = {
        "ms_per_message": {
            "65536": {"ring": {"host_ms": 0.05, "wall_ms": 2.2}, "ring-unwatched": {"host_ms": 0.01, "wall_ms": 2.1}},
            "3145728": {"ring": {"host_ms": 0.4, "wall_ms": 4.5}, "ring-unwatched": {"host_ms": 0.13, "wall_ms": 2.3}},
        }
    }
    found = speed.hop_host_us(hops)
    assert found["65536"]["watched_us"] == pytest.approx(50.0) and found["65536"]["met"] is True
    assert found["3145728"]["unwatched_us"] == pytest.approx(130.0) and found["3145728"]["met"] is False


def test_the_summary_file_and_lines_say_mps_shape_ratios_and_goals(speed, tmp_path, capsys):
    bench = _bench(_row("rtp", 950, [8.0, 7.5]), _row("fsdp2", 1000, [10.0, 10.0]), _row("ddp", 1900, [20.0, 20.0]))
    bench["results"].append(_row("rtp-offload", 760, [5.0, 4.5]))  # 1.25x rtp's step time, 3 GB less a rank
    bench["settings"]["threads"] = 8
    bench["environment"] = {
        "device_name": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "nccl_loaded": "2.32.3",
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    argv = ["summary", "--bench", str(tmp_path / "bench.json"), "--hops", str(tmp_path / "absent.json")]
    argv += ["--mps", "on", "--mps-why", "server 42", "--output", str(tmp_path / "out.json")]
    assert speed.main(argv) == 0  # a hop probe that did not finish leaves its part out, not the summary
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["mps"] == {"on": True, "why": "server 42"} and summary["hop_host_us"] is None
    assert summary["shape"]["preset"] == "llama-1b" and summary["shape"]["parameters"] == 1_235_814_400
    assert summary["strategies"]["rtp"]["peak_gb_per_rank"] == pytest.approx([8.0, 7.5])
    printed = capsys.readouterr().out
    assert "NVIDIA H200" in printed and "CUDA MPS on: server 42" in printed and "1.24B parameters" in printed
    assert "rtp/fsdp2: tokens/s 0.95x, peak per rank 0.80x" in printed
    assert "goal: rtp's tokens/s >= 0.9x FSDP2's: 0.95x, met" in printed
    offload = dict(summary["offload"])
    assert offload.pop("not_run") == [] and offload.pop("host_threads") == 8  # approx takes no nested values
    assert offload == pytest.approx({"step_time": 1.25, "saved_gb": 3.0, "peak": 0.625})
    assert "rtp-offload/rtp: step time 1.25x, peak per rank 0.62x (3.000 GB saved per rank)" in printed
    assert "goal: rtp's step time with CPUOffloadOptimizer <= 1.3x rtp's (AdamW on the device): 1.25x, met" in printed


def test_the_1b_preset_is_llama_3_2_1bs_shape():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_rtp.tools.bench.presets import PRESETS

    config = LlamaConfig(**PRESETS["llama-1b"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400  # the head tied: counted once
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (16, 2048, 128256)


class _Layer:
    def __init__(self, name: str):
        self.name, self.forward, self.backward = name, None, None

    def set_modules_to_forward_prefetch(self, modules):
        self.forward = [m.name for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        self.backward = [m.name for m in modules]


def test_fsdp2s_explicit_prefetch_looks_ahead_in_forward_and_back_in_backward():
    from hf_rtp.tools.bench.worker import prefetch

    layers = [_Layer(str(i)) for i in range(4)]
    prefetch(layers, 2)
    assert [layer.forward for layer in layers] == [["1", "2"], ["2", "3"], ["3"], None]
    # backward runs the layers last to first: each prefetches the ones it meets next
    assert [layer.backward for layer in layers] == [None, ["0"], ["1", "0"], ["2", "1"]]
    untouched = [_Layer("0"), _Layer("1")]
    prefetch(untouched, 0)  # FSDP2's implicit prefetch: nothing set
    assert all(layer.forward is None and layer.backward is None for layer in untouched)
    with pytest.raises(ValueError):
        prefetch(layers, -1)
