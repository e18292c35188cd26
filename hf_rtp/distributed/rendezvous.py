"""Where calls every rank must make (forward, generate, save) meet before they communicate.

They meet on a small gloo group with a short timeout (HF_RTP_ENTRY_TIMEOUT, default 60 s), so a rank
that skips one is an error within a minute on every rank that entered, never a silent wait; and ranks
that arrive in different calls (one saving while another runs a forward) fail at once, each call named.
"""

from __future__ import annotations

import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CollectiveMisuseError

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
    )
}


def enter(
    call: str, entry: dist.ProcessGroup | None, rank: int, world_size: int, timeout: timedelta, who: str = "rank"
) -> None:
    """Meet every other rank (`who`: every rank of the ring, say) at the start of `call` on the `entry`
    group, or fail on every rank that came."""
    if world_size == 1:
        return
    mine = torch.tensor([zlib.crc32(call.encode())], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    start = time.monotonic()
    try:
        dist.all_gather(everyone, mine, group=entry)
    except RuntimeError as err:
        waited = time.monotonic() - start
        if waited < 0.9 * timeout.total_seconds():  # no timeout: the connection to a peer broke
            raise CollectiveMisuseError(
                f"{call} is collective, and rank {rank} lost another {who} after {waited:.1f} s: that rank's process "
                f"exited or was killed (gloo: {str(err).strip().splitlines()[0][:200]}). Its own error, in its "
                "log, is the cause; the other ranks cannot go on without it."
            ) from err
        raise CollectiveMisuseError(
            f"{call} is collective: every {who} must call it, but rank {rank} waited {waited:.0f} s "
            f"(HF_RTP_ENTRY_TIMEOUT is {timeout.total_seconds():g} s) and not every rank came. "
            f"Call {call} on every rank (not under `if accelerator.is_main_process:`), and give every rank "
            "the same number of batches."
        ) from err
    if len({int(t) for t in everyone}) > 1:
        _CALLS.setdefault(int(mine), call)
        names = [_CALLS.get(int(t), "another hf_rtp call") for t in everyone]
        raise CollectiveMisuseError(
            "ranks entered different collective calls at once: "
            + ", ".join(f"{who} {r}: {n}" for r, n in enumerate(names))
            + ". Every rank must make the same calls in the same order."
        )
