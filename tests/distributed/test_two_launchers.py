"""Two launchers on one machine standing in for two nodes (torchrun --nnodes 2, 2 ranks each): a ring
inside each "node", data parallel across them, and each "node" with a Hub cache of its own."""

import json
import os
import subprocess
import sys

from support.models import fake_hub_cache, make_tiny
from support.spawn import finish_launchers, free_port

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "launched_step.py")
OLD, NEW = "a" * 40, "b" * 40


def _launch(node: int, port: int, cache: str, out: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(node),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        SCRIPT,
        out,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache, "HF_RTP_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )


def test_two_nodes_of_two_ranks_train_save_like_vanilla_ddp_reading_one_revision(tmp_path):
    old, new = make_tiny("llama", tmp_path / "old", seed=0), make_tiny("llama", tmp_path / "new", seed=1)
    caches = [
        fake_hub_cache(str(tmp_path / "node0"), "org/tiny", {OLD: old}),
        fake_hub_cache(str(tmp_path / "node1"), "org/tiny", {OLD: old, NEW: new}),
    ]  # node 1's main moved on
    out, port = str(tmp_path / "out"), free_port()
    os.makedirs(out)
    procs = [_launch(node, port, caches[node], out) for node in (0, 1)]
    outputs = finish_launchers(procs, timeout=240)
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-6000:]
    seen = []
    for rank in range(4):
        with open(os.path.join(out, f"rank-{rank}.json")) as f:
            seen.append(json.load(f))
    assert [(s["dp"], s["rtp"]) for s in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # one ring per node
    # every rank read rank 0's revision, each from its own node's cache
    for rank, s in enumerate(seen):
        assert s["read"] == os.path.join(caches[rank // 2], "models--org--tiny", "snapshots", OLD)
    assert len({s["loss"] for s in seen}) == 4
    for rank in range(4):  # hf_rtp destroyed the world group it made, at exit (launched_step.py)
        with open(os.path.join(out, f"exit-{rank}.json")) as f:
            assert json.load(f) == {"initialized": False}, rank
    assert sorted(os.listdir(os.path.join(out, "saved"))) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
