"""`hf-rtp estimate --optimizer-offload`: the optimizer's state and step in host memory, for hf_rtp's
CPUOffloadOptimizer, FSDP2's CPUOffloadPolicy and DeepSpeed ZeRO-3 Offload (hf_rtp/tools/memory_offload.py), and
issue 68's two goals by estimate."""

import pytest
import torch
from transformers import LlamaConfig

from hf_rtp.tools import memory, memory_offload
from hf_rtp.tools.bench.presets import PRESETS
from hf_rtp.tools.memory_qlora import main as estimate_command


@pytest.fixture
def config():
    return LlamaConfig(**PRESETS["llama-90m"])


def params(config) -> int:
    return sum(p.numel() for p in memory._meta_model(config, torch.float32).parameters())


def test_pinned_buffers_are_rounded_as_torch_s_pinned_allocator_rounds_them():
    assert [memory.pinned(b) for b in (0, 1, 3, 4096, 4097, 3 * 2**30)] == [0, 1, 4, 4096, 8192, 2**32]


def test_offload_leaves_the_parameters_and_their_gradients_on_the_device(config):
    rows = ("rtp-offload", "fsdp2-offload", "zero3-offload")
    two, four = (memory.estimate(config, n, optimizer_offload=True) for n in (2, 4))
    assert set(rows) <= set(two) and not set(rows) & set(memory.estimate(config, 2))
    for e in (two, four):
        assert e["rtp-offload"] < e["rtp"] and e["fsdp2-offload"] < e["fsdp2"]
    for strategy in rows:
        assert four[strategy] < two[strategy], strategy
    # the optimizer's state is the host's: the device rows do not depend on it
    sgd = memory.estimate(config, 2, optimizer="sgd", optimizer_offload=True)
    assert all(sgd[s] == two[s] for s in rows)
    # at the step the device holds the rank's rows and their gradients, in the weights' dtype
    held = sum(memory.rtp_local_numels(memory._meta_model(config, torch.float32), 2))
    bf16 = memory.estimate(config, 2, dtype=torch.bfloat16, optimizer_offload=True)
    assert two["rtp-offload"] >= 2 * held * 4
    assert two["rtp-offload"] - bf16["rtp-offload"] == pytest.approx(2 * held * 2, rel=0.25)
    # ZeRO-3 keeps a bf16 partition of every parameter on the GPU (DeepSpeed's own estimate), nothing else per rank
    assert two["zero3-offload"] - four["zero3-offload"] == pytest.approx(2 * params(config) / 4)


def test_host_memory_holds_masters_gradient_buffers_and_moments_of_each_rank_s_rows(config):
    n, total = 2, params(config)
    local = memory.rtp_local_numels(memory._meta_model(config, torch.float32), n)
    adamw = memory.host_bytes(config, n, pin=False)
    assert adamw["rtp-offload"] == 16 * sum(local)  # float32 master, gradient buffer, two moments
    assert adamw["zero3-offload"] == 16 * total / n
    # FSDP2 pads each shard to ceil(rows / N) rows: at least the rank's share
    assert 16 * total / n <= adamw["fsdp2-offload"] < 16 * total / n * 1.01
    # RTP's replicated parameters (the norms) are whole on every rank: a little more than 1/N
    assert 16 * total / n < adamw["rtp-offload"] < 16 * total / n * 1.01
    assert memory.host_bytes(config, n, optimizer="sgd", pin=False)["rtp-offload"] == 8 * sum(local)
    # bf16 weights: each rank's rows staged in bf16 too (the step follows writes to them), 2 bytes an element more
    bf16 = memory.host_bytes(config, n, dtype=torch.bfloat16, pin=False)
    assert bf16["rtp-offload"] - adamw["rtp-offload"] == 2 * sum(local)
    assert bf16["fsdp2-offload"] == adamw["fsdp2-offload"]
    assert memory.host_bytes(config, n, pin=False) == adamw  # "auto" is still the config's dtype, not the last one's
    # pinned: the master and the gradient buffer rounded up to a power of two each, the moments not
    pinned = memory.host_bytes(config, n)
    assert pinned["rtp-offload"] == sum(2 * memory.pinned(4 * e) + 8 * e for e in local)
    assert adamw["rtp-offload"] < pinned["rtp-offload"] < adamw["rtp-offload"] * 1.5
    assert pinned["zero3-offload"] == adamw["zero3-offload"]


def test_the_command_prints_the_offload_rows_and_the_host_memory_per_node(config, tmp_path, capsys):
    config.save_pretrained(tmp_path)
    argv = [str(tmp_path), "--world-size", "4", "--gpus-per-node", "2"]
    result = estimate_command([*argv, "--optimizer-offload"])
    out = capsys.readouterr().out
    for strategy in ("rtp-offload", "fsdp2-offload", "zero3-offload"):
        assert f"  {strategy} " in out
    host = memory.host_bytes(config, 4, dtype=torch.float32)
    assert "host memory per node of 2 GPUs" in out
    assert f"{host['rtp-offload'] * 2 / 1e9:.1f} GB for rtp-offload" in out
    assert {k: v for k, v in result.items() if not k.endswith("-offload")} == estimate_command(argv)
    with pytest.raises(SystemExit, match="--optimizer-offload"):
        estimate_command([*argv, "--load-in-4bit", "--optimizer-offload"])


def test_issue_68_goals_fit_by_estimate_with_the_optimizer_in_host_memory():
    """bf16 autocast over float32 weights, AdamW, gradient checkpointing, 1 x 4096 tokens per rank, on CUDA:
    Llama-3-70B on 8 x 80 GB and Llama-3-8B on 4 x 24 GB do not fit with RTP alone and fit with CPUOffloadOptimizer."""
    for row in memory_offload.goals():
        gpu = row["gpu_gb"]
        device, host = row["device_gb"], row["host_gb_per_node"]
        assert device["rtp"] > gpu, row
        assert device["rtp-offload"] < gpu, row
        # host per node (one node: every rank): 16 bytes per parameter, a little more for pinned rounding
        assert host["zero3-offload"] <= host["rtp-offload"] < host["zero3-offload"] * 1.1, row
