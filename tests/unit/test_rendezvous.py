"""hf_rtp/distributed/ranks/rendezvous.py in one process: what a meeting carries, that a world of one needs no group,
that every call hf_rtp meets at is one whose name a mismatch can spell out, and the roll call that names a rank
that never answered. (The meeting of several ranks: tests/faults/test_collective_misuse.py; _missing:
test_missing_ranks_are_named.py.)"""

from __future__ import annotations

import ast
import socket
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import hf_rtp
from hf_rtp.distributed.ranks import rendezvous
from hf_rtp.distributed.ranks.rendezvous import _CALLS, PAYLOAD, _absent, enter, same_settings

SECOND = timedelta(seconds=1)


def test_a_world_of_one_meets_without_a_group_and_gets_its_payload_back_zero_padded():
    assert not dist.is_initialized()  # and no group is needed: entry is None
    assert enter("forward", None, 0, 1, SECOND, payload=(7, -3)) == [[7, -3, 0, 0, 0, 0]]
    assert enter("generate", None, 0, 1, SECOND) == [[0] * PAYLOAD]
    assert enter("forward", None, 0, 1, SECOND, payload=range(PAYLOAD)) == [list(range(PAYLOAD))]


def test_a_payload_longer_than_a_meeting_carries_is_refused_even_in_one_process():
    with pytest.raises(ValueError, match=f"at most {PAYLOAD} integers, got {PAYLOAD + 1}"):
        enter("forward", None, 0, 1, SECOND, payload=[1] * (PAYLOAD + 1))


def test_settings_need_no_comparison_in_a_world_of_one():
    assert same_settings("generate", {"max_new_tokens": "4", "do_sample": "False"}, None, 1) is None


def _meeting_names() -> set[str]:
    """Every literal call name hf_rtp passes to a meeting: topology.enter("..."), mesh.meet("..."),
    rendezvous.enter("...")."""
    found = set()
    for path in Path(hf_rtp.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            first = node.args[0]
            if name in ("enter", "meet") and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
    return found


def test_every_call_hf_rtp_meets_at_is_one_a_mismatch_names():
    """Ranks in different calls see each other's call as a CRC: only the names in _CALLS read back as words
    on the other ranks ("rank 1: save_pretrained"), any other as "another hf_rtp call"."""
    used = _meeting_names()
    assert len(used) >= 6, used  # the scan finds the call sites at all
    assert used == set(_CALLS.values()), used ^ set(_CALLS.values())
    assert len(_CALLS) == len({zlib.crc32(n.encode()) for n in used})  # no two names share a CRC


def test_the_roll_call_names_the_rank_that_never_answered(monkeypatch):
    """_absent, with the launcher's store (here a real TCPStore in this process) and rank 1 silent."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(rendezvous, "ROLL_CALL_S", 0.3)  # how long the answered ranks wait for the others
    host = socket.gethostname()
    processes = ((host, 11), ("node-b", 12))
    assert _absent("save_pretrained", 0, processes, wait=True) == "rank 1 on node-b, which did not answer within 0.3 s"
    assert _absent("save_pretrained", 0, processes, wait=False) == ""  # answered, and says nothing without waiting
    monkeypatch.delenv("MASTER_ADDR")
    assert _absent("save_pretrained", 0, processes, wait=True) == ""  # no store to ask: no guess
