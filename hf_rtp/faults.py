"""Named points where a test (or a user reproducing a failure) can kill or stop a rank on purpose.

HF_RTP_FAULT="<action>@<point>[#<rank>][:<n>]" makes rank <rank> (every rank if omitted) take
<action> the <n>-th time (default the first) it reaches <point>:

    kill   SIGKILL itself, as an OOM killer or a lost node would
    stop   SIGSTOP itself, as a hung or swapped-out process would (alive, silent)
    raise  raise OSError, as a full disk or a failed write would

Points: "load.read" (after the headers, before the weights are read), "forward", "replicas.reduce"
(backward on a 2-D grid: a piece's gradient came home, before its all-reduce over the replicas), "save.write" (a
save_pretrained's files half written), "save.commit" (staged, nothing moved yet), "save.commit.mid"
(half the files moved), "state.write" (a training state's files written, before they are
committed), "state.commit" (about to replace the old training state), "state.commit.aside" (the
fallback's old folder renamed aside, the new one not yet in place), "resize.draw" (resize_token_embeddings,
each rank about to run vanilla's resize on the whole matrices). A point name that does not exist
is an error naming these. Unset, a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import re
import signal

from .errors import SettingError

POINTS = (
    "load.read",
    "forward",
    "replicas.reduce",
    "save.write",
    "save.commit",
    "save.commit.mid",
    "state.write",
    "state.commit",
    "state.commit.aside",
    "resize.draw",
)
_hits: dict[tuple[str, str], int] = {}  # by setting: a new HF_RTP_FAULT counts from zero


def parse(spec: str) -> tuple[str, str, int | None, int]:
    """(action, point, rank or None, n) from an HF_RTP_FAULT value. A typo is an error, never a fault
    that silently never fires (a test would then pass without testing anything)."""
    match = re.fullmatch(r"(kill|stop|raise)@([\w.]+)(?:#(\d+))?(?::(\d+))?", spec)
    if match is None:
        raise SettingError(f"HF_RTP_FAULT must look like 'kill@save.commit#1:2' (kill, stop or raise), got {spec!r}")
    action, where, rank, nth = match.groups()
    if where not in POINTS:
        raise SettingError(f"HF_RTP_FAULT names no fault point {where!r}; the points are {', '.join(POINTS)}")
    return action, where, None if rank is None else int(rank), int(nth or 1)


def check() -> None:
    """Validate HF_RTP_FAULT once, up front (from_pretrained calls it)."""
    if os.environ.get("HF_RTP_FAULT"):
        parse(os.environ["HF_RTP_FAULT"])


def point(name: str) -> None:
    spec = os.environ.get("HF_RTP_FAULT")
    if not spec:
        _hits.clear()  # the same fault set again later counts from zero, once a point was reached while unset
        return
    assert name in POINTS, name
    action, where, rank, nth = parse(spec)
    if where != name or (rank is not None and rank != int(os.environ.get("RANK", 0))):
        return
    _hits[spec, name] = _hits.get((spec, name), 0) + 1
    if _hits[spec, name] != nth:
        return
    if action == "raise":
        raise OSError(28, f"No space left on device (injected by HF_RTP_FAULT at {name})")
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
