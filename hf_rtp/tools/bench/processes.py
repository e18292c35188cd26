"""Start one strategy's ranks (fresh interpreters, or forks of a preloaded rank server: rank_server.py)
and watch their resident memory from outside.

Every process starts with MALLOC_MMAP_THRESHOLD_=65536, so blocks freed by the program go back to
the OS and VmRSS measures the program rather than glibc's cache. The sampler lives in the parent,
so a busy rank cannot delay its own samples; each sample carries a wall-clock time, which lets the
caller cut the series into phases the ranks report (load, train).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def vm_rss(pid: int) -> int:
    """Resident bytes of a process (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_env(threads: int = 1, extra: dict | None = None) -> dict:
    """What every rank of a bench run starts with, and the rank server too (see rank_server.py)."""
    return dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        **(extra or {}),
    )


def rank_only_env(rank: int, world_size: int, port: int) -> dict:
    """What torch.distributed reads when a rank calls it: all that differs between ranks."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def device_args(args) -> list[str]:
    """The worker's --device and --backend, as `hf-rtp bench` was given them."""
    return ["--device", args.device] + (["--backend", args.backend] if getattr(args, "backend", None) else [])


def rank_env(rank: int, world_size: int, port: int, threads: int = 1, extra: dict | None = None) -> dict:
    return {**common_env(threads, extra), **rank_only_env(rank, world_size, port)}


_server: RankServer | None = None
_START_TIMEOUT_S = 600  # the server's imports and forks, when the run itself has no timeout


@contextlib.contextmanager
def preloaded_ranks(threads: int = 1):
    """Within it, run_ranks forks ranks from one server that imported torch, transformers and hf_rtp
    once (rank_server.py), instead of starting an interpreter per rank; the server ends with it. Nested
    inside one with the same `threads` (several bench runs in one script or test module), it uses that
    server: its forks start as fresh as the first ones (tests/e2e/test_bench_rank_server.py)."""
    global _server
    if _server is not None and _server.threads == threads and _server.proc.poll() is None:
        yield _server
        return
    outer, server = _server, RankServer(threads)
    _server = server
    try:
        yield server
    finally:
        _server = outer
        server.close()


class RankServer:
    """The parent's end of rank_server.py: one request per strategy run, one line per answer."""

    def __init__(self, threads: int):
        self.threads = threads
        self.folder = tempfile.TemporaryDirectory(prefix="hf_rtp-ranks-")
        self._log = open(os.path.join(self.folder.name, "server.err"), "w+")  # noqa: SIM115  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hf_rtp.tools.bench.rank_server"],
            # should an import ever ask whether CUDA is there, torch answers through NVML, which leaves
            # the server without a CUDA context its forks could not use
            env={**common_env(threads), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._pending = b""
        self._runs = 0

    def launch(self, module: str, args: list[str], world_size: int, port: int, timeout: float | None) -> _Forked:
        self._runs += 1
        ranks = [
            {
                "env": rank_only_env(rank, world_size, port),
                "stdout": os.path.join(self.folder.name, f"{self._runs}-{rank}.out"),
                "stderr": os.path.join(self.folder.name, f"{self._runs}-{rank}.err"),
            }
            for rank in range(world_size)
        ]
        assert self.proc.stdin is not None  # a pipe, from Popen above
        self.proc.stdin.write((json.dumps({"module": module, "args": args, "ranks": ranks}) + "\n").encode())
        self.proc.stdin.flush()
        try:  # the first answer also waits for the server's imports
            pids = self.answer(_START_TIMEOUT_S if timeout is None else timeout)["pids"]
        except TimeoutError:
            raise RuntimeError(f"the bench's rank server did not start `{module}`'s ranks within the timeout") from None
        return _Forked(self, pids, ranks)

    def answer(self, timeout: float | None) -> dict:
        """The server's next line; TimeoutError if none within `timeout` seconds."""
        assert self.proc.stdout is not None  # a pipe, from Popen above
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                self._log.seek(0)
                raise RuntimeError(f"the bench's rank server exited:\n{self._log.read()[-4000:]}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the server's loop ends at end of input
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        self.folder.cleanup()


class _Forked:
    """One strategy's ranks, forked by the rank server."""

    def __init__(self, server: RankServer, pids: list[int], ranks: list[dict]):
        self.server, self.pids, self.ranks = server, pids, ranks

    def finish(self, timeout: float | None) -> list[tuple[int, str, str]]:
        try:
            exits = self.server.answer(timeout)["exits"]
        except TimeoutError:
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.server.answer(30)  # the server has reaped them
            raise
        ranks = zip(exits, self.ranks, strict=True)
        return [(code, _read(rank["stdout"]), _read(rank["stderr"])) for code, rank in ranks]


class _Started:
    """One strategy's ranks, each a fresh interpreter."""

    def __init__(self, module: str, args: list[str], world_size: int, port: int, threads: int, extra_env):
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=rank_env(rank, world_size, port, threads, extra_env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world_size)
        ]
        self.pids = [p.pid for p in self.procs]

    def finish(self, timeout: float | None) -> list[tuple[int, str, str]]:
        try:
            outputs = [p.communicate(timeout=timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            raise TimeoutError from None
        return [(p.returncode, out, err) for p, (out, err) in zip(self.procs, outputs, strict=True)]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run_ranks(
    module: str,
    args: list[str],
    world_size: int,
    threads: int = 1,
    interval: float = 0.002,
    extra_env: dict | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """Run `module.main(args)` as ranks 0..world_size-1; return each rank's last JSON line, with
    "rss_samples": [(time, bytes), ...] added. Raises with the failing rank's stderr. Inside
    `preloaded_ranks` the ranks are forks of its server (extra_env needs fresh interpreters)."""
    port = free_port()
    ranks = (
        _server.launch(module, args, world_size, port, timeout)
        if _server is not None and extra_env is None
        else _Started(module, args, world_size, port, threads, extra_env)
    )
    samples: list[list[tuple[float, int]]] = [[] for _ in ranks.pids]
    running = True

    def sample():
        while running:
            now = time.time()
            for series, pid in zip(samples, ranks.pids, strict=True):
                series.append((now, vm_rss(pid)))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        outputs = ranks.finish(timeout)
    except TimeoutError:
        raise RuntimeError(f"`python -m {module}` did not finish within {timeout} s on {world_size} ranks") from None
    finally:
        running = False
        sampler.join()
    failed = [(rank, err) for rank, (code, _, err) in enumerate(outputs) if code != 0]
    if failed:
        rank, err = failed[0]
        raise RuntimeError(f"rank {rank} of `python -m {module} {' '.join(args)}` failed:\n{err[-4000:]}")
    reports = []
    for series, (_, out, _) in zip(samples, outputs, strict=True):
        report = json.loads(out.strip().splitlines()[-1])
        report["rss_samples"] = series
        reports.append(report)
    return reports


def peak_between(samples: list[tuple[float, int]], start: float, end: float) -> int:
    """The highest sample taken in [start, end]; 0 if none was."""
    return max((rss for t, rss in samples if start <= t <= end), default=0)
