"""hf_rtp/distributed/ranks/topology.py in one process: how `rings` reads rtp_size and a device_mesh (and refuses what
cannot be a set of whole rings), and the one-process Topology that `setup` gives with Settings.resolve(), both
without torch.distributed and on a real gloo group of one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hf_rtp.distributed.ranks.topology import rings, setup
from hf_rtp.errors import TopologyError
from hf_rtp.settings import Settings


@pytest.mark.parametrize(
    "world, rtp_size, expected",
    [
        (1, None, [(0,)]),
        (4, None, [(0, 1, 2, 3)]),  # default: one flat ring of every rank
        (4, 2, [(0, 1), (2, 3)]),  # contiguous ranks: under torchrun a ring stays inside a node
        (6, 3, [(0, 1, 2), (3, 4, 5)]),
        (6, 1, [(0,), (1,), (2,), (3,), (4,), (5,)]),
        (8, 8, [tuple(range(8))]),
    ],
)
def test_rtp_size_cuts_the_ranks_into_contiguous_rings(world, rtp_size, expected):
    assert rings(None, rtp_size, world) == expected


@pytest.mark.parametrize("rtp_size", [0, -2, True, 2.0, "2"])
def test_an_rtp_size_that_is_not_a_positive_number_of_ranks_is_refused(rtp_size):
    with pytest.raises(TopologyError, match=f"rtp_size must be a positive number of ranks per ring, got {rtp_size!r}"):
        rings(None, rtp_size, 4)


def test_an_rtp_size_that_does_not_divide_the_world_names_the_divisors():
    with pytest.raises(TopologyError, match=r"rtp_size=4 does not divide the 6 ranks.*\(1, 2, 3, 6\)"):
        rings(None, 4, 6)
    with pytest.raises(TopologyError, match="rtp_size=2 does not divide the 1 ranks"):
        rings(None, 2, 1)


@pytest.fixture
def one_rank():
    """A real gloo process group of one rank (meshes need one), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_device_meshes_give_their_rows_as_rings_and_wrong_ones_are_refused(one_rank):
    flat = init_device_mesh("cpu", (1,))
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "rtp"))
    assert rings(flat, None, 1) == [(0,)]
    assert rings(grid, None, 1) == [(0,)]
    assert rings(grid, 1, 1) == [(0,)]  # an rtp_size that agrees with the mesh is fine
    refused = [
        (flat, None, 2, "the device mesh has 1 ranks but the process group has 2"),
        (grid, None, 2, "must hold every one of the 2 ranks exactly once"),
        (grid, 2, 1, "rtp_size=2 contradicts the device mesh, whose rings have 1 ranks"),
        (init_device_mesh("cpu", (1, 1), mesh_dim_names=("rtp", "dp")), None, 1, r"dims \('rtp', 'dp'\)"),
        (init_device_mesh("cpu", (1, 1)), None, 1, "a 2-D one with dims named \\('dp', 'rtp'\\), got dims None"),
        (init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c")), None, 1, r"of shape \(1, 1, 1\)"),
    ]
    for mesh, rtp_size, world, message in refused:
        with pytest.raises(TopologyError, match=message):
            rings(mesh, rtp_size, world)


def _check_single(topology) -> None:
    assert (topology.rank, topology.world_size, topology.rtp_rank, topology.rtp_size) == (0, 1, 0, 1)
    assert (topology.dp_rank, topology.dp_size) == (0, 1) and topology.is_writer
    assert topology.mesh is None and topology.group is None and topology.entry is None  # nothing communicates
    assert topology.device == torch.device("cpu")
    assert topology.enter("forward", [5]) == [[5, 0, 0, 0, 0, 0]]
    topology.same_settings("generate", {"max_new_tokens": "4"})


def test_one_process_without_torch_distributed_is_a_ring_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    _check_single(setup(Settings.resolve(device="cpu")))
    assert not dist.is_initialized()  # setup started no process group for one process
    with pytest.raises(TopologyError, match=r"a device_mesh was given but torch\.distributed is not initialised"):
        setup(Settings.resolve(device="cpu"), device_mesh=object())
    with pytest.raises(TopologyError, match="rtp_size=2 does not divide the 1 ranks"):
        setup(Settings.resolve(device="cpu"), rtp_size=2)


def test_a_process_group_of_one_is_a_ring_of_one_with_or_without_its_mesh(monkeypatch, one_rank):
    monkeypatch.setenv("WORLD_SIZE", "1")
    settings = Settings.resolve(device="cpu")
    _check_single(setup(settings))
    _check_single(setup(settings, device_mesh=init_device_mesh("cpu", (1,))))
    with pytest.raises(TopologyError, match="rtp_size=3 does not divide the 1 ranks"):
        setup(settings, rtp_size=3)
