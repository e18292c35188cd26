"""How the ring's messages travel, for every way a world can be started (distributed/transport/backends.py).

The decision reads which backend serves the tensors' device, never the world's backend string: a world started
with no backend reports 'undefined' (and, on a CUDA build, serves CUDA tensors with NCCL), torchtitan writes
"cuda:nccl,cpu:gloo", accelerate "nccl". On NCCL a hop's sends and receives must be posted together; gloo sends
CPU tensors only, so CUDA tensors on a gloo world go through host memory.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_rtp.distributed.transport.backends import backend_map, transport_for
from hf_rtp.errors import TopologyError

CASES = [
    # (backend string or config, device type, transport)
    ("nccl", "cuda", "batched"),
    ("undefined", "cuda", "batched"),
    ("undefined", "cpu", "plain"),
    ("cpu:gloo,cuda:nccl", "cuda", "batched"),
    ("cuda:nccl,cpu:gloo", "cuda", "batched"),
    ("cpu:gloo,cuda:nccl", "cpu", "plain"),
    ("cuda:nccl,cpu:gloo", "cpu", "plain"),
    ("gloo", "cpu", "plain"),
    ("gloo", "cuda", "staged"),
    ("cpu:gloo,cuda:gloo", "cuda", "staged"),
    ("cpu:gloo", "cuda", "staged"),  # a CPU build's world started without a backend, asked for GPU tensors
    (" CPU:gloo , CUDA:nccl ", "cuda", "batched"),
    ("ucc", "cpu", "plain"),  # backends hf_rtp knows no rule for send as they are asked to, as before
    ("ucc", "cuda", "plain"),
    ("mpi", "cpu", "plain"),
]


@pytest.mark.parametrize(("config", "device", "expected"), CASES)
def test_every_backend_string(config, device, expected):
    assert transport_for(config, device) == expected


@pytest.mark.parametrize(("config", "device"), [("nccl", "cpu"), ("cuda:nccl", "cpu"), ("cuda:nccl", "xpu")])
def test_a_world_that_cannot_carry_the_tensors_is_refused_by_name(config, device):
    with pytest.raises(TopologyError, match=f"cannot send {device} tensors"):
        transport_for(config, device)


def test_backend_map_reads_configs_and_bare_names():
    assert backend_map("cuda:nccl,cpu:gloo") == {"cuda": "nccl", "cpu": "gloo"}
    assert backend_map("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert backend_map("nccl") == {"cuda": "nccl"}


def test_what_this_torch_reports_for_a_world_without_a_backend_is_read_right(tmp_path):
    """The config string torch itself gives (not one typed here) for init_process_group() with no backend."""
    dist.init_process_group(init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "undefined"
        assert transport_for(dist.get_backend_config(), "cpu") == "plain"
    finally:
        dist.destroy_process_group()
