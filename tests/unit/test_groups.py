"""hf_rtp's own process groups (distributed/ranks/groups.py) on a real gloo world of one rank: one group per role and
ranks, made once and carrying the timeout it was asked with; made afresh for a new world; torn down at exit
before the world, and the world only when hf_rtp made it. Several ranks asking for the groups in one order is
what every multi-rank test does (distributed/ranks/topology.py's setup)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_rtp.distributed.ranks import groups


@pytest.fixture
def own_groups(monkeypatch):
    """The module's bookkeeping of this test only; the process leaves with no world initialised."""
    monkeypatch.setattr(groups, "_groups", {})
    monkeypatch.setattr(groups, "_groups_world", [])
    monkeypatch.setattr(groups, "_world", [])
    assert not dist.is_initialized()
    yield groups
    if dist.is_initialized():
        dist.destroy_process_group()


def _world_of_one() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _alive(group) -> bool:
    try:
        dist.get_backend(group)
    except ValueError:  # "... is not initialized in the world group map"
        return False
    return True


def test_one_group_per_role_and_ranks_with_the_timeout_asked(own_groups):
    _world_of_one()
    made = own_groups.group("control", (0,), "gloo", timedelta(seconds=77))
    assert made is not dist.group.WORLD and _timeout(made) == timedelta(seconds=77)
    assert own_groups.group("control", (0,), "gloo", timedelta(seconds=77)) is made
    other = own_groups.group("entry", (0,), "gloo", timedelta(seconds=5))
    assert other is not made and _timeout(other) == timedelta(seconds=5)
    assert dist.get_process_group_ranks(made) == [0]
    # a world made again (a script that destroyed and re-initialised it) gets groups of its own
    dist.destroy_process_group()
    _world_of_one()
    again = own_groups.group("control", (0,), "gloo", timedelta(seconds=77))
    assert again is not made and _alive(again)


def test_a_world_made_again_never_gets_the_groups_of_a_destroyed_one(own_groups, monkeypatch):
    """A world destroyed and made again can be given the destroyed one's address, so its id(): CPython reuses freed
    memory (about one world in five did, here). The destroyed world's groups died with it and must never come back.
    The first worlds leave that to the allocator; the last ones all get one id(), its worst case, so the test never
    depends on the allocator's luck."""
    timeout = timedelta(seconds=60)
    for i in range(80):
        if i == 60:
            monkeypatch.setattr(groups, "id", lambda _: 0, raising=False)  # shadows the builtin, in groups.py only
        _world_of_one()
        made = own_groups.group("control", (0,), "gloo", timeout)
        assert _alive(made), f"world {i} got a destroyed world's group"
        assert own_groups.group("control", (0,), "gloo", timeout) is made  # and still one per role, in a world
        ones = torch.ones(2)
        dist.all_reduce(ones, group=made)  # it works, too
        assert ones.tolist() == [1.0, 1.0]
        dist.destroy_process_group()


def test_at_exit_its_groups_go_first_and_a_world_it_did_not_make_stays(own_groups):
    _world_of_one()  # the user's (or accelerate's) world
    made = own_groups.group("control", (0,), "gloo", timedelta(seconds=60))
    own_groups._destroy_groups()
    assert not _alive(made) and dist.is_initialized() and _alive(dist.group.WORLD)
    assert own_groups._groups == {}
    dist.destroy_process_group()
    own_groups._destroy_groups()  # nothing left to destroy: no error


def test_a_world_it_made_goes_after_its_groups(own_groups):
    own_groups.init_world(backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    assert own_groups._registered  # the exit handler is in place
    made = own_groups.group("control", (0,), "gloo", timedelta(seconds=60))
    own_groups._destroy_groups()
    assert not _alive(made) and not dist.is_initialized()
    # a world the script made after destroying hf_rtp's is the script's
    own_groups.init_world(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
    _world_of_one()
    own_groups._destroy_groups()
    assert dist.is_initialized()
