"""The recipe on two accelerate launchers as two nodes (recipes/configs/multinode.yaml on localhost)."""

import os
import subprocess

import pytest
import torch
from support.recipes import ENV, accelerate_launch, finetune, metrics, resuming, run, torchrun
from transformers import AutoModelForCausalLM


def test_two_accelerate_launchers_as_two_nodes_train_like_one_launcher(default_run, tmp_path):
    """recipes/configs/multinode.yaml on localhost: 2 "nodes" of 2 processes, a ring of 2 in each, resuming
    a flat 2-rank checkpoint; one launcher of 4 processes in a flat ring takes the same steps."""
    from support.spawn import finish_launchers, free_port

    flat, nodes = tmp_path / "flat", tmp_path / "nodes"
    run([*torchrun(4), *finetune(flat, 6, *resuming(default_run))])
    port = free_port()
    launch = [
        *accelerate_launch("multinode.yaml"),
        "--num_processes",
        "4",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
    ]
    procs = [
        subprocess.Popen(
            [*launch, "--machine_rank", str(node), *finetune(nodes, 6, "--rtp_size", "2", *resuming(default_run))],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = finish_launchers(procs, timeout=300)
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-5000:]
    assert "4 rank(s): 2 replica(s) of a 2-rank ring" in outputs[0]
    expected = metrics(flat)
    assert [r["step"] for r in metrics(nodes)] == [5, 6]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in metrics(nodes)] == pytest.approx([r[key] for r in expected], rel=1e-5)
    a = AutoModelForCausalLM.from_pretrained(os.path.join(flat, "final")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(os.path.join(nodes, "final")).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
