"""Start one strategy's ranks as fresh processes and watch their resident memory from outside.

Every process starts with MALLOC_MMAP_THRESHOLD_=65536, so blocks freed by the program go back to
the OS and VmRSS measures the program rather than glibc's cache. The sampler lives in the parent,
so a busy rank cannot delay its own samples; each sample carries a wall-clock time, which lets the
caller cut the series into phases the ranks report (load, train).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def rank_env(rank: int, world_size: int, port: int, threads: int = 1, extra: dict | None = None) -> dict:
    return dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS=str(threads),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        **(extra or {}),
    )


def run_ranks(
    module: str,
    args: list[str],
    world_size: int,
    threads: int = 1,
    interval: float = 0.002,
    extra_env: dict | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """Run `python -m module *args` as ranks 0..world_size-1; return each rank's last JSON line,
    with "rss_samples": [(time, bytes), ...] added. Raises with the failing rank's stderr."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=rank_env(rank, world_size, port, threads, extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    samples: list[list[tuple[float, int]]] = [[] for _ in procs]
    running = True

    def sample():
        while running:
            now = time.time()
            for series, p in zip(samples, procs, strict=True):
                series.append((now, vm_rss(p.pid)))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"`python -m {module}` did not finish within {timeout} s on {world_size} ranks") from None
    finally:
        running = False
        sampler.join()
    failed = [(rank, err) for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)) if p.returncode != 0]
    if failed:
        rank, err = failed[0]
        raise RuntimeError(f"rank {rank} of `python -m {module} {' '.join(args)}` failed:\n{err[-4000:]}")
    reports = []
    for series, (out, _) in zip(samples, outputs, strict=True):
        report = json.loads(out.strip().splitlines()[-1])
        report["rss_samples"] = series
        reports.append(report)
    return reports


def peak_between(samples: list[tuple[float, int]], start: float, end: float) -> int:
    """The highest sample taken in [start, end]; 0 if none was."""
    return max((rss for t, rss in samples if start <= t <= end), default=0)
