"""How the GPU check's ranks share one GPU, and what it runs on (`.ci/gpu`, docs/testing.md "On a GPU").

Every rank is on cuda:0. tests/support/spawn.py's run_on_ranks sets LOCAL_RANK to the rank, from which hf_rtp
(and torch's launchers) pick a GPU per rank, so a rank joins the world here first and passes device="cuda:0" to
from_pretrained, as a user sharing one GPU would: hf_rtp then joins that world instead of starting NCCL on
GPU LOCAL_RANK. Setting LOCAL_RANK=0 on every rank would do it too, but would also make every rank its node's
first (hf_rtp downloads from the Hub on those), which no real launch does.

The world is the one .ci/gpu chose (HF_RTP_TEST_BACKEND):
- "cpu:gloo,cuda:nccl" with NCCL_MULTI_RANK_GPU_ENABLE=1 where the NCCL library torch loaded is 2.30 or newer
  (NCCL's env.rst: experimental, two ranks per GPU with its defaults; earlier NCCL refuses two ranks on a GPU);
- else "cpu:gloo,cuda:gloo", a world whose backend cannot send CUDA tensors point to point: hf_rtp's ring copies
  each message through host memory (distributed/transport/backends.py's "staged").

`python tests/gpu/gpu_world.py FILE` prints the versions and the choice (.ci/gpu's first stage) and writes the
variables to export to FILE, one NAME=value a line. Before it chooses the NCCL world it tries it (`probe`): two
ranks on cuda:0 all-reduce and exchange 64 MiB each way (above NCCL's buffers, so a send posted alone would
block) within a minute. If that fails, the check says why, exits 1, and the later stages run in the gloo world,
so one broken NCCL does not cost every stage's result.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

NCCL_WORLD = "cpu:gloo,cuda:nccl"
GLOO_WORLD = "cpu:gloo,cuda:gloo"
MULTI_RANK_NCCL = (2, 30, 0)  # NCCL_MULTI_RANK_GPU_ENABLE's first release (NCCL's env.rst)
TIMEOUT_S = 60  # as tests/support/spawn.py's collectives: a bug fails in a minute instead of hanging
NO_CUDA = "needs an NVIDIA GPU: .ci/gpu runs it on one (docs/testing.md)"


def nccl_version(code: int) -> tuple[int, int, int]:
    """ncclGetVersion's integer as (major, minor, patch): X*10000 + Y*100 + Z since NCCL 2.9, X*1000 + Y*100 + Z
    before (NCCL_VERSION_CODE in nccl.h)."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def mapped_nccl(maps: str) -> list[str]:
    """The NCCL libraries (libnccl.so*, not its plugins) a process maps, from the text of its /proc/PID/maps, in
    the order they appear."""
    paths: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libnccl.so") and fields[5] not in paths:
            paths.append(fields[5])
    return paths


RTLD_NOLOAD = 4  # <dlfcn.h>, glibc: a handle only to a library this process has loaded already


def _version_of(library) -> tuple[int, int, int] | None:
    code = ctypes.c_int()
    return nccl_version(code.value) if library.ncclGetVersion(ctypes.byref(code)) == 0 else None  # 0: ncclSuccess


def loaded_nccl() -> tuple[list[tuple[str, tuple[int, int, int] | None]], tuple[int, int, int] | None]:
    """After `import torch` and a first CUDA call: (path, version) of each NCCL library this process maps, each
    version read with that library's own ncclGetVersion; and the version of the one the name libnccl.so.2 resolves
    to, as it resolved when torch's CUDA library loaded (None where none is loaded by that name).

    torch.cuda.nccl.version() is the version torch was built with. A pip-installed torch preloads the NCCL of its
    site-packages by path (torch/__init__.py, _preload_cuda_deps), so LD_LIBRARY_PATH does not replace it; a
    library in LD_PRELOAD is loaded first and is the one torch calls, while the preloaded file stays mapped beside
    it: two files, one in use."""
    import torch

    torch.zeros(1, device="cuda")
    with open("/proc/self/maps") as f:
        mapped = [(path, _version_of(ctypes.CDLL(path))) for path in mapped_nccl(f.read())]
    try:
        bound = _version_of(ctypes.CDLL("libnccl.so.2", mode=RTLD_NOLOAD))
    except OSError:
        bound = None
    return mapped, bound


def choose(versions: list[tuple[int, int, int]]) -> dict[str, str]:
    """The variables that put two ranks on one GPU: NCCL's multi-rank mode when every NCCL given (the one torch
    calls, else every one mapped) is 2.30 or newer, else the gloo world."""
    if versions and min(versions) >= MULTI_RANK_NCCL:
        return {"HF_RTP_TEST_BACKEND": NCCL_WORLD, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    return {"HF_RTP_TEST_BACKEND": GLOO_WORLD}


def join_world(backend: str | None = None):
    """In a rank of run_on_ranks: this rank on cuda:0, in the world HF_RTP_TEST_BACKEND names (or `backend`);
    returns the device to pass to from_pretrained."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    backend = backend or os.environ.get("HF_RTP_TEST_BACKEND", GLOO_WORLD)
    options = {"device_id": device} if "nccl" in backend else {}  # NCCL's communicator made now, on cuda:0
    dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S), **options)
    return device


PROBE_ELEMENTS = 16 * 2**20  # float32: 64 MiB, many times NCCL's buffers (NCCL_BUFFSIZE: 4 MiB by default)


def _probe_rank(rank: int, port: int, errors) -> None:
    """One rank of `probe`: the NCCL world on cuda:0, an all-reduce, then one ring hop each way posted together."""
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group(NCCL_WORLD, timeout=timedelta(seconds=TIMEOUT_S), device_id=device)
        total = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(total)
        send = torch.full((PROBE_ELEMENTS,), float(rank), device=device)
        recv = torch.empty_like(send)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        torch.cuda.synchronize()
        got = (total.tolist(), recv.min().item(), recv.max().item())
        if got != ([3.0] * 4, float(peer), float(peer)):
            raise RuntimeError(f"wrong values: all_reduce {got[0]}, received between {got[1]} and {got[2]}")
        errors.put((rank, None))  # before the teardown, which NCCL may make slow: the parent kills a lingering rank
        dist.destroy_process_group()
    except BaseException as err:  # the parent reports it, then runs the gloo world
        errors.put((rank, f"{type(err).__name__}: {err}"))


def probe(timeout_s: float = 50.0) -> str | None:
    """None where two ranks on cuda:0 run NCCL's multi-rank mode (NCCL_MULTI_RANK_GPU_ENABLE=1), else what went
    wrong. Spawned (the parent has started CUDA), killed when they overrun."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    before = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # read when NCCL initialises, in the ranks
    try:
        procs = [ctx.Process(target=_probe_rank, args=(rank, port, errors)) for rank in range(2)]
        for p in procs:
            p.start()
    finally:
        if before is None:
            os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE")
        else:
            os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = before
    deadline, outcome = time.monotonic() + timeout_s, {}
    while len(outcome) < 2 and time.monotonic() < deadline:
        try:
            rank, error = errors.get(timeout=1.0)
            outcome[rank] = error
        except Exception:  # queue.Empty: look whether a rank died without a word
            dead = [p.exitcode for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
            if dead:
                outcome.setdefault(-1, f"a rank exited without a result (exit codes {dead})")
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if len(outcome) < 2 and -1 not in outcome:
        return f"no result within {timeout_s:.0f} s (a hang)"
    failed = [f"rank {r}: {e}" if r >= 0 else e for r, e in sorted(outcome.items()) if e]
    return "; ".join(failed) or None


def _dotted(version) -> str:
    return "unreadable" if version is None else ".".join(map(str, version))


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"
    except Exception as err:  # a library that is there but fails at import says why
        return f"import failed: {type(err).__name__}: {err}"


def report() -> dict[str, str]:
    """Print what the check runs on; return the variables chosen."""
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    props = torch.cuda.get_device_properties(0)
    print(
        f"GPU 0 of {torch.cuda.device_count()}: {props.name}, compute capability {props.major}.{props.minor}, "
        f"{props.total_memory / 2**30:.1f} GiB"
    )
    for module in ("transformers", "accelerate", "peft", "bitsandbytes", "trl"):
        print(f"{module} {_version(module)}")
    built = torch.cuda.nccl.version()
    print(f"NCCL torch was built with: {_dotted(built) if isinstance(built, tuple) else built}")
    mapped, bound = loaded_nccl()
    for path, version in mapped:
        print(f"NCCL mapped: {_dotted(version)} from {path}")
    if bound is not None:
        print(f"NCCL torch calls (libnccl.so.2 as the loader resolves it): {_dotted(bound)}")
        versions = [bound]
    elif mapped:
        versions = [v for _, v in mapped if v is not None]
    else:  # a torch that links NCCL statically runs the one it was built with
        print("NCCL mapped: no libnccl file (linked into torch: the built one)")
        versions = [built] if isinstance(built, tuple) and len(built) == 3 else []
    chosen = {**choose(versions), **_overridden()}
    if "nccl" in chosen["HF_RTP_TEST_BACKEND"]:
        started = time.monotonic()
        failure = probe()
        if failure is None:
            print(
                f"NCCL's multi-rank mode on GPU 0: two ranks all-reduced and swapped 64 MiB in "
                f"{time.monotonic() - started:.1f} s"
            )
        else:
            print(f"FAILED: two ranks on GPU 0 in {NCCL_WORLD} with NCCL_MULTI_RANK_GPU_ENABLE=1: {failure}")
            chosen = {"HF_RTP_TEST_BACKEND": GLOO_WORLD, "PROBE_FAILED": "1"}
    print("two ranks on GPU 0: " + ", ".join(f"{k}={v}" for k, v in chosen.items() if k != "PROBE_FAILED"))
    return chosen


def _overridden() -> dict[str, str]:
    """HF_RTP_TEST_BACKEND set before .ci/gpu ran wins over the choice (to try a world by hand)."""
    given = os.environ.get("HF_RTP_TEST_BACKEND")
    return {"HF_RTP_TEST_BACKEND": given} if given else {}


if __name__ == "__main__":
    # python tests/gpu/gpu_world.py [FILE]: the report on stdout; the chosen variables in FILE, NAME=value a line
    chosen = report()
    failed = chosen.pop("PROBE_FAILED", None)
    if sys.argv[1:]:
        with open(sys.argv[1], "w") as out:
            out.write("".join(f"{k}={v}\n" for k, v in chosen.items()))
    sys.exit(1 if failed else 0)  # the later stages run in the gloo world; this stage fails
