"""The harness that starts every multi-rank test (tests/support/spawn.py): a port lost between free_port() and
rank 0's bind (another process took it: seen once in a CI run, where three ranks then waited out the test's 300 s)
is tried again on a new port at once."""

from __future__ import annotations

import socket
import time

import support.spawn as spawn


def _join():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank()


def test_a_port_taken_before_rank_0_binds_it_is_retried_on_a_new_one(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        drawn: list[int] = []
        real = spawn.free_port

        def first_one_taken() -> int:  # the race, made certain: the first port drawn is another process's
            drawn.append(taken.getsockname()[1] if not drawn else real())
            return drawn[-1]

        monkeypatch.setattr(spawn, "free_port", first_one_taken)
        started = time.monotonic()
        assert spawn.run_on_ranks(_join, 3, timeout=120) == [0, 1, 2]
    assert len(drawn) == 2 and time.monotonic() - started < 100, (drawn, time.monotonic() - started)
