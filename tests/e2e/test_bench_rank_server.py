"""The bench forks each strategy's ranks from one preloaded server (hf_rtp/tools/bench/rank_server.py): a
forked rank must start as a fresh interpreter would, in memory above all, since the bench measures it."""

import os

import psutil
import pytest

from hf_rtp.tools.bench import processes
from hf_rtp.tools.bench.processes import preloaded_ranks, run_ranks

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTED_WITH = ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")


def test_forked_ranks_start_as_fresh_interpreters_and_failures_are_reported_and_reaped(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)  # the ranks import support.rank_probe
    fresh = run_ranks("support.rank_probe", [], 2)
    with preloaded_ranks(threads=1) as rank_server:
        server = psutil.Process(rank_server.proc.pid)
        forked = run_ranks("support.rank_probe", [], 2)
        with pytest.raises(RuntimeError, match=r"rank 0 of .* failed:\nthis rank failed on purpose"):
            run_ranks("support.rank_probe", ["fail"], 2)
        with pytest.raises(RuntimeError, match=r"did not finish within 2 s on 2 ranks"):
            run_ranks("support.rank_probe", ["stop"], 2, timeout=2)
        assert server.children() == []  # the stopped ranks were killed and reaped
        with preloaded_ranks(threads=1) as nested:  # a bench run inside keeps this server, and leaves it
            assert nested is rank_server
        with preloaded_ranks(threads=2) as other:  # other threads: a server of its own, closed after it
            assert other is not rank_server and processes._server is other
        assert other.proc.poll() is not None and processes._server is rank_server
        again = run_ranks("support.rank_probe", [], 2)  # and the server still serves
    assert not server.is_running()
    assert {r["pid"] for r in forked}.isdisjoint(r["pid"] for r in again)  # a new fork for every run
    for rank in (0, 1):
        expected = {"RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        for report in (forked[rank], again[rank]):
            assert {k: report[k] for k in STARTED_WITH} == expected
            assert not report["cuda_initialized"]
            # the libraries' pages a fresh process has resident after its imports: without them a fork
            # starts ~90 MB lower and grows by them while the bench measures it
            assert abs(report["VmRSS"] - fresh[rank]["VmRSS"]) < 0.05 * fresh[rank]["VmRSS"], (report, fresh[rank])
            assert report["RssFile"] > 0.8 * fresh[rank]["RssFile"], (report, fresh[rank])
