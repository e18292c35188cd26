"""A process that imports torch, transformers and hf_rtp once, then forks each strategy's ranks from itself.

Importing them costs a new interpreter about 5 s of CPU; a bench runs a dozen strategies of two to
eight ranks each, so most of its wall time went to imports no measurement looks at. A fork starts in
milliseconds with those modules already resident, as a fresh process has them after its imports.

What stays as in a fresh process: the server never runs a model, a torch op or CUDA, so a rank
starts with no thread pool, no CUDA context, no process group and no allocation of a previous rank;
each rank is a new fork, so nothing one strategy does reaches the next. A fork does not inherit the
page-table entries of file-backed pages (the libraries' code the imports ran, ~90 MB), which a fresh
process has resident after importing: a rank maps them again before anything runs (`_map_again`), so
its VmRSS starts where a fresh process's does instead of growing by them during the measurement.
The server is started with
the ranks' common environment (MALLOC_MMAP_THRESHOLD_, which glibc reads at start, OMP_NUM_THREADS,
what huggingface_hub and transformers read at import); a rank adds only its RANK, WORLD_SIZE and
master address, which torch.distributed reads when the rank calls it. A rank measures its memory
above its own baseline, taken after the fork, as it does after a fresh interpreter's imports.

Protocol, one JSON object per line: the parent sends {"module", "args", "ranks": [{"env", "stdout",
"stderr"}, ...]}; the server forks every rank, answers {"pids": [...]}, waits for them and answers
{"exits": [...]}. A rank runs `module.main(args)` with its stdout and stderr in the files named.
"""

from __future__ import annotations

import array
import ctypes
import importlib
import json
import os
import sys
import traceback


def main() -> None:
    importlib.import_module("hf_rtp.tools.bench.worker")  # torch, transformers and hf_rtp with it
    resident = _resident_file_pages()
    for line in sys.stdin:
        request = json.loads(line)
        pids = [_fork(request["module"], request["args"], rank, resident) for rank in request["ranks"]]
        _answer({"pids": pids})
        _answer({"exits": [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]})


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _resident_file_pages() -> list[tuple[int, int]]:
    """(address, bytes) runs of the readable file-backed pages this process has mapped in (pagemap's bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = array.array("Q", pagemap.read((end - start) // page * 8))
            run_start = None
            for i, entry in enumerate([*entries, 0]):  # a trailing absent page closes the last run
                address = start + i * page
                if entry >> 63 and run_start is None:
                    run_start = address
                elif not entry >> 63 and run_start is not None:
                    runs.append((run_start, address - run_start))
                    run_start = None
    return runs


def _map_again(runs: list[tuple[int, int]]) -> None:
    """Fault the server's resident file pages into this fork's page table (from the page cache: no I/O)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    for address, length in runs:
        if libc.madvise(address, length, _MADV_POPULATE_READ) != 0:  # before Linux 5.14: read a byte per page
            for offset in range(0, length, page):
                ctypes.string_at(address + offset, 1)


_MADV_POPULATE_READ = 22


def _fork(module: str, args: list[str], rank: dict, resident: list[tuple[int, int]]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _map_again(resident)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, rank["stdout"]), (2, rank["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.environ.update(rank["env"])
        sys.argv = [module, *args]
        importlib.import_module(module).main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never return into the server's loop, nor run its exit handlers


if __name__ == "__main__":
    main()
