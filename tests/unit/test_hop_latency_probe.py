"""benchmarks/hop_latency_cuda.py runs on a lent GPU, whose minutes are counted: a rank that dies must end the
probe at once, naming it, not after the probe's whole timeout (its first run on an H100 waited out 180 s for two
ranks that had died importing hf_rtp)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time

import pytest

PROBE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "hop_latency_cuda.py")


def _probe():
    spec = importlib.util.spec_from_file_location("hop_latency_cuda", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures(results, rank: int) -> None:
    results.put((rank, {}, "batched"))


def _dies() -> None:
    os._exit(3)


def _figures_then_dies(results, rank: int) -> None:
    results.put((rank, {}, "batched"))
    results.close()
    results.join_thread()  # the figures are in the queue before the exit code says failure
    os._exit(3)


def _late_figures(results, rank: int) -> None:
    time.sleep(3)
    results.put((rank, {}, "batched"))


def _collected(*targets, timeout: float):
    """The probe's _collect over processes running `targets` ((function, args) each), every one joined after."""
    probe = _probe()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=f, args=tuple(results if a is _QUEUE else a for a in args)) for f, args in targets]
    for p in procs:
        p.start()
    try:
        return probe._collect(results, procs, timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=10)


_QUEUE = object()  # stands for the results queue in a target's arguments


def test_a_rank_that_exits_without_its_figures_ends_the_wait_at_once_by_name():
    began = time.monotonic()
    with pytest.raises(SystemExit, match=r"rank 1 \(exit code 3\) ended without its figures"):
        _collected((_figures, (_QUEUE, 0)), (_dies, ()), timeout=120.0)
    assert time.monotonic() - began < 30  # seconds after the exit, not the 120 s timeout


def test_every_ranks_figures_are_collected():
    got = _collected((_figures, (_QUEUE, 0)), (_figures, (_QUEUE, 1)), timeout=60.0)
    assert sorted(rank for rank, _, _ in got) == [0, 1]


def test_a_rank_failing_after_its_figures_does_not_throw_the_run_away():
    """A rank's teardown (destroy_process_group) may exit non-zero after it delivered: the other's figures still
    count."""
    got = _collected((_figures_then_dies, (_QUEUE, 0)), (_late_figures, (_QUEUE, 1)), timeout=60.0)
    assert sorted(rank for rank, _, _ in got) == [0, 1]
