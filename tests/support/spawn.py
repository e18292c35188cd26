"""Run a function on N real processes joined over gloo, as torchrun would start them.

The function runs with RANK / WORLD_SIZE / MASTER_* set and no process group yet, so hf_rtp's own
initialisation from the launcher environment is what gets exercised. Its return value (picklable)
comes back per rank; an exception on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = "60"  # a bug fails in a minute instead of hanging for ten


def _stacks_later() -> None:
    """.ci/gpu (HF_RTP_TEST_STACKS_AFTER_S): every thread's stacks to stderr after that many seconds, and again
    each time as many pass, so that a rank that hangs prints where before its stage is killed."""
    if os.environ.get("HF_RTP_TEST_STACKS_AFTER_S"):
        faulthandler.dump_traceback_later(float(os.environ["HF_RTP_TEST_STACKS_AFTER_S"]), repeat=True)


# A rank unpickles _worker, importing this module, before the test's module and whatever that imports (transformers,
# a CUDA library's first load): a hang there would come before _worker, so the timer starts here; and a rank that
# crashes in C prints its stack (faulthandler's handlers for SIGSEGV, SIGABRT and the like). A rank is known by its
# name, which multiprocessing sets before it unpickles; parent_process() is set only after.
if multiprocessing.current_process().name != "MainProcess":
    faulthandler.enable()
    _stacks_later()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS_PER_WORKER = 400
_drawn = 0


def free_port() -> int:
    """A port no other test and no connection will take before rank 0 binds it.

    A port the kernel hands out (bind to 0) is in its ephemeral range, where every outgoing connection (gloo's,
    another test's TCPStore clients) also draws its local port: one did take it between the draw and rank 0's bind,
    failing a CI run. So the ports come from below that range, and each pytest-xdist worker draws from a block of
    its own, in turn from a start that depends on its process id: two workers, or two pytest runs, never draw the
    same port at once. A port still held (a test's TCPStore not yet closed) is skipped."""
    global _drawn
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    blocks = max(1, (_ephemeral_low() - 10000) // _PORTS_PER_WORKER)
    base = 10000 + (index % blocks) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = base + (os.getpid() * 7 + _drawn) % _PORTS_PER_WORKER
        _drawn += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # the whole block held: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, inherited, env, results, preloaded=False):
    at_import = import_time_environment(os.environ)  # the fork server's, from its start
    os.environ.clear()  # the fork server's environment is from its own start: take the test's as of now
    os.environ.update(inherited)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        HF_RTP_TIMEOUT=COLLECTIVE_TIMEOUT_S,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    os.environ.update(env)
    _stacks_later()  # from the function's start, for a preloaded rank that imported nothing else
    import torch

    torch.set_num_threads(1)
    try:
        if preloaded:
            now = import_time_environment(os.environ)
            changed = sorted(k for k in {*now, *at_import} if now.get(k) != at_import.get(k))
            if changed:
                raise RuntimeError(
                    f"this test sets {', '.join(changed)}, which transformers or huggingface_hub read at import "
                    "and the preloaded fork server read otherwise: call run_on_ranks(..., fresh=True)"
                )
            from transformers.utils import logging as transformers_logging

            transformers_logging.set_verbosity(transformers_logging.log_levels[os.environ["TRANSFORMERS_VERBOSITY"]])
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn,
    world_size: int,
    *args,
    env: dict | None = None,
    timeout: float = 300,
    attempts: int = 3,
    survivors: tuple[int, ...] | None = None,
    fresh: bool = False,
    linger_s: float = 30,
):
    """fn(*args) on `world_size` processes; returns the per-rank results in rank order.

    With `survivors`, only those ranks are waited for (the others were killed or stopped on purpose
    by a fault injected through HF_RTP_FAULT) and the rest are killed once they have reported. With
    `fresh`, each rank is a new interpreter that imports everything itself (see PRELOAD). A rank still alive
    `linger_s` seconds after every result came is killed (on an H100, a rank whose NCCL peer had aborted a group
    took over 30 s to exit, in NCCL's teardown, after its result was in).
    """
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, env or {}, timeout, survivors, fresh, linger_s)
        except RuntimeError as err:
            if "address already in use" not in str(err).lower() or attempt == attempts - 1:
                raise


# What every rank imports anyway, imported once by the fork server: a rank then starts as a fork of it
# instead of importing transformers afresh (about 3 s of CPU per rank on CI's two cores, most of a
# short test). Each rank is still a fresh fork, so nothing one test does reaches the next.
PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2.modeling_qwen2",
    "accelerate",
    "safetensors.torch",
    "huggingface_hub",
    "datasets",  # Trainer, TRL and the recipes' data: about a second per rank that uses them
    "transformers.trainer",
    "peft",
    "trl",
    "hf_rtp",
]


def import_time_environment(environ) -> dict[str, str]:
    """The variables huggingface_hub, transformers and datasets read when imported (caches, offline mode,
    endpoints, tokens): a preloaded rank has them as the fork server had them. hf_rtp's own (HF_RTP_*) are
    read at each call, and the verbosity is set again in each rank."""
    prefixes = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(prefixes) and not k.startswith("HF_RTP_") and k != "TRANSFORMERS_VERBOSITY"
    }


def _context(fresh: bool):
    """The fork server above (preloaded), or with `fresh` one that preloads only torch: a rank then imports
    transformers itself, under whatever environment the test gives it."""
    ctx = mp.get_context("forkserver" if not fresh else "spawn")
    if not fresh:
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_once(fn, world_size, args, env, timeout, survivors=None, fresh=False, linger_s=30.0):
    wanted = tuple(range(world_size)) if survivors is None else survivors
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    inherited = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, inherited, env, results, not fresh))
        for r in range(world_size)
    ]
    # a fresh (spawned) rank unpickles `fn`, importing its test module and whatever that imports, before
    # _worker applies `env`: the variables must already be in the environment the interpreter starts with
    started_with = dict(os.environ)
    if fresh:
        os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(started_with)
    outcome: dict = {}
    try:
        _collect(results, procs, wanted, outcome, timeout)
    finally:
        for rank, p in enumerate(procs):
            if rank not in wanted:
                p.kill()  # stopped (SIGSTOP) ranks never exit by themselves
            p.join(timeout=linger_s)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [outcome[r][1] for r in wanted]


def _collect(results, procs, wanted, outcome, timeout) -> None:
    """Each wanted rank's (ok, value) into `outcome`, failing at once, with its exit code, when a rank ended
    without one: a rank killed by a signal or crashed in C (a segfault in a CUDA library) reports nothing, and
    waiting the whole timeout for it would only hide why (a negative code is the signal's number)."""
    deadline = time.monotonic() + timeout
    while not set(wanted) <= set(outcome):
        try:
            rank, ok, value = results.get(timeout=1.0)
            outcome[rank] = (ok, value)
            if not ok and "address already in use" in str(value).lower():
                # rank 0 lost its port to another process between free_port() and its bind: the others would
                # wait the whole timeout for a store that never comes; run_on_ranks tries again on a new port
                for p in procs:
                    p.kill()
                raise RuntimeError(f"--- rank {rank} ---\n{value}")
            continue
        except queue.Empty:
            pass
        ended = {r: procs[r].exitcode for r in wanted if r not in outcome and procs[r].exitcode is not None}
        if ended:
            with contextlib.suppress(queue.Empty):  # what a rank put just before it exited is still in the pipe
                while True:
                    rank, ok, value = results.get(timeout=2.0)
                    outcome[rank] = (ok, value)
            ended = {r: code for r, code in ended.items() if r not in outcome}
            if ended:
                raise RuntimeError(f"ranks {sorted(ended)} exited without a result (exit codes {ended})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(set(wanted) - set(outcome))} gave no result within {timeout}s")


def finish_launchers(procs, timeout: float) -> list[str]:
    """The output of each launcher (subprocess.Popen with start_new_session=True, stdout piped), after
    it exits; any still running when the wait ends is killed with every process under it (kill_launcher),
    so that no rank left waiting for a peer outlives the test."""

    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_launcher(proc)
    return outputs


def kill_launcher(proc) -> None:
    """SIGKILL a launcher (started with start_new_session=True), its process group and every process
    under it. torchrun starts each rank in a session of its own, so killing the launcher's group
    alone leaves its ranks behind (a SIGSTOPped one forever); they are found through /proc first,
    while they are still the launcher's descendants."""
    import signal

    for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_matching(text: str) -> None:
    """SIGKILL every process whose command line holds `text` (a test's own unique folder)."""
    import signal

    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
