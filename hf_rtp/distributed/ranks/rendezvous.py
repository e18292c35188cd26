"""Where calls every rank must make (forward, generate, save) meet before they communicate.

They meet on a small gloo group with a short timeout (HF_RTP_ENTRY_TIMEOUT, default 60 s), so a rank
that skips one is an error within a minute on every rank that entered, never a silent wait; and ranks
that arrive in different calls (one saving while another runs a forward) fail at once, each call named.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import CollectiveMisuseError

PAYLOAD = 6  # integers a meeting carries beside the call's name: one fixed width, whatever the call

_CALLS = {
    zlib.crc32(c.encode()): c
    for c in (
        "forward",
        "generate",
        "save_pretrained",
        "push_to_hub",
        "resize_token_embeddings",
        "full_tensor",
        "redistribute",
        "context_parallel",
        "initialize_lora_eva_weights",
        "PeftModel.save_pretrained",
        "generate's step",
        "sync_grads",
        "a forward's new replicated parameters",
    )
}


def enter(
    call: str,
    entry: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    timeout: timedelta,
    who: str = "rank",
    processes: tuple[tuple[str, int], ...] = (),
    payload: Sequence[int] = (),
) -> list[list[int]]:
    """Meet every other rank (`who`: every rank of the ring, say) at the start of `call` on the `entry`
    group, or fail on every rank that came. `processes`, every global rank's (host, pid), lets a failure
    name the ranks on this host whose process is gone or stopped, or else those on any host that do not
    answer a roll call. `payload`: up to PAYLOAD integers each rank brings along (what a forward's ranks
    agree on, model/traffic.py); every rank's are returned, zero-padded, in rank order."""
    if len(payload) > PAYLOAD:
        raise ValueError(f"a meeting carries at most {PAYLOAD} integers, got {len(payload)}")
    if world_size == 1:
        return [[*payload, *[0] * (PAYLOAD - len(payload))]]
    mine = torch.tensor([zlib.crc32(call.encode()), *payload, *[0] * (PAYLOAD - len(payload))], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    start = time.monotonic()
    try:
        dist.all_gather(everyone, mine, group=entry)
    except RuntimeError as err:
        waited = time.monotonic() - start
        broke = waited < 0.9 * timeout.total_seconds()  # no timeout: the connection to a peer broke
        # A killed process closes its sockets before it turns zombie: give a dying peer a moment to show.
        gone = _missing(processes, grace_s=EXIT_GRACE_S if broke else 0.0)
        absent = _absent(call, rank, processes, wait=not gone)  # answered in any case: others may be waiting
        if broke:
            who_exited = f"{gone}'s process" if gone else f"the process of {absent}" if absent else "a rank's process"
            raise CollectiveMisuseError(
                f"{call} is collective, and rank {rank} lost another {who} after {waited:.1f} s: "
                f"{who_exited} exited or was killed (gloo: "
                f"{str(err).strip().splitlines()[0][:200]}). Its own error, in its log, is the cause; the other "
                "ranks cannot go on without it."
            ) from err
        raise CollectiveMisuseError(
            f"{call} is collective: every {who} must call it, but rank {rank} waited {waited:.0f} s "
            f"(HF_RTP_ENTRY_TIMEOUT is {timeout.total_seconds():g} s) and not every rank came"
            + (f" ({gone} is stopped or gone)" if gone else "")
            + (f" ({absent}: gone, stopped or in another call)" if absent else "")
            + ". "
            f"Call {call} on every rank (not under `if accelerator.is_main_process:`), and give every rank "
            "the same number of batches."
        ) from err
    if len({int(t[0]) for t in everyone}) > 1:
        _CALLS.setdefault(int(mine[0]), call)
        names = [_CALLS.get(int(t[0]), "another hf_rtp call") for t in everyone]
        raise CollectiveMisuseError(
            "ranks entered different collective calls at once: "
            + ", ".join(f"{who} {r}: {n}" for r, n in enumerate(names))
            + ". Every rank must make the same calls in the same order."
        )
    return [t[1:].tolist() for t in everyone]


EXIT_GRACE_S = 2.0
"""How long a meet whose connection broke watches this host's ranks for one that is exiting (_missing)."""


def _missing(processes: tuple[tuple[str, int], ...], grace_s: float = 0.0) -> str:
    """ "rank 1" / "ranks 1, 3": ranks on this host whose process has exited, is a zombie or is stopped
    (SIGSTOP, a debugger); "" when none is, or when they run on other hosts, which cannot be looked at.
    With `grace_s`, keeps looking that long while none is: a process being killed has already closed its
    connections (which is how the others learnt of it) while /proc still shows it running."""
    host = socket.gethostname()
    local = [(r, pid) for r, (where, pid) in enumerate(processes) if where == host]
    deadline = time.monotonic() + grace_s
    while True:
        found = [r for r, pid in local if _state(pid) in ("gone", "X", "x", "Z", "T", "t")]
        if found or not local or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not found:
        return ""
    return ("rank " if len(found) == 1 else "ranks ") + ", ".join(map(str, found))


ROLL_CALL_S = 5.0
"""How long the ranks whose meet failed wait for each other at the roll call (_absent)."""
_roll_calls = 0


def _absent(call: str, rank: int, processes: tuple[tuple[str, int], ...], wait: bool) -> str:
    """ "rank 2 on node-b, which did not answer within 5 s": the ranks that did not answer a roll call, for
    when no process this host can look at is gone (_missing). Every rank whose meet failed records itself
    in the launcher's store (MASTER_ADDR:MASTER_PORT, which torchrun's agent keeps even when rank 0 is
    gone), also one that found the culprit on its own host, or the waiting ranks would name it; with
    `wait`, it then waits ROLL_CALL_S for the others: a rank that never answers is gone, stopped or in
    another call, on whatever host. "" without `wait`, when the store cannot be reached or every rank
    answered."""
    global _roll_calls
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not processes or not address or not port.isdigit():
        return ""
    _roll_calls += 1  # a later failed meet in this process calls the roll afresh
    key = f"hf_rtp/roll-call/{zlib.crc32(repr(processes).encode())}/{call}/{_roll_calls}"
    try:
        store = dist.TCPStore(
            address, int(port), is_master=False, timeout=timedelta(seconds=ROLL_CALL_S), wait_for_workers=False
        )
        store.set(f"{key}/{rank}", "here")
        arrived, deadline = store.add(f"{key}/count", 1), time.monotonic() + ROLL_CALL_S
        if not wait:
            return ""
        while arrived < len(processes) and time.monotonic() < deadline:
            time.sleep(0.1)
            arrived = store.add(f"{key}/count", 0)
        answered = {r for r in range(len(processes)) if store.check([f"{key}/{r}"])}
    except (RuntimeError, ValueError, OSError):  # no store to reach: say nothing rather than guess
        return ""
    found = [r for r in range(len(processes)) if r not in answered]
    if not found:
        return ""
    where = ", ".join(sorted({processes[r][0] for r in found}))
    ranks = ("rank " if len(found) == 1 else "ranks ") + ", ".join(map(str, found))
    return f"{ranks} on {where}, which did not answer within {ROLL_CALL_S:g} s"


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, Z, T, ...), "gone" if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "?"


_SHOWN = 60  # bytes of each differing value a failure shows per rank


def same_settings(call: str, settings: dict[str, str], entry: dist.ProcessGroup | None, world_size: int) -> None:
    """Every rank passed `call` the same `settings` (name -> its value's repr, the same names on every rank), or
    every rank fails at once, naming each setting that differs with every rank's value. Ranks that already met
    at `call` (enter) run this right after."""
    if world_size == 1:
        return
    names = sorted(settings)
    mine = torch.tensor([zlib.crc32(settings[n].encode()) for n in names], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=entry)
    differ = [n for i, n in enumerate(names) if len({int(t[i]) for t in everyone}) > 1]
    if not differ:
        return
    shown = torch.zeros(len(differ), _SHOWN, dtype=torch.uint8)
    for i, name in enumerate(differ):
        text = settings[name].encode()[:_SHOWN]
        shown[i, : len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    values = [torch.zeros_like(shown) for _ in range(world_size)]
    dist.all_gather(values, shown, group=entry)

    def value(rank: int, i: int) -> str:
        return bytes(values[rank][i].tolist()).rstrip(b"\0").decode(errors="replace")

    raise CollectiveMisuseError(
        f"ranks called {call} with different settings: "
        + "; ".join(
            f"{n} (" + ", ".join(f"rank {r}: {value(r, i)}" for r in range(world_size)) + ")"
            for i, n in enumerate(differ)
        )
        + f". Every rank's {call} steps together: pass every rank the same settings (each rank its own inputs)."
    )
