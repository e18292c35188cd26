"""Named points where a test (or a user reproducing a failure) can kill or stop a rank on purpose.

HF_RTP_FAULT="<action>@<point>[#<rank>][:<n>]" makes rank <rank> (every rank if omitted) take
<action> the <n>-th time (default the first) it reaches <point>:

    kill     SIGKILL itself, as an OOM killer or a lost node would
    stop     SIGSTOP itself, as a hung or swapped-out process would (alive, silent)
    raise    raise OSError, as a full disk or a failed write would
    corrupt  make the result computed there wrong, as a miscompiled kernel would (only at the points that compute
             one, CORRUPTIBLE: `point` returns True and the caller spoils its own result)

Points: "load.read" (after the headers, before the weights are read), "forward", "replicas.reduce"
(backward on a 2-D grid: a piece's gradient came home, before its all-reduce over the replicas), "save.write" (a
save_pretrained's files half written), "save.commit" (staged, nothing moved yet), "save.commit.mid"
(half the files moved), "state.write" (a training state's files written, before they are
committed), "state.commit" (about to replace the old training state), "state.commit.aside" (the
fallback's old folder renamed aside, the new one not yet in place), "resize.draw" (resize_token_embeddings,
each rank about to run vanilla's resize on the whole matrices), "attention.probe" (the check of a ring attention
kernel against attention computed whole, layers/attention.py: "corrupt" shifts its merged output), "ring.hop" (a
ring about to post a hop of a walk: weights, gradients or tokens; `kill@ring.hop#1:40` kills rank 1 mid-walk,
where its neighbours have hops in flight to it). A point name
that does not exist is an error naming these. Unset, a point costs one dictionary lookup.
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
    "attention.probe",
    "ring.hop",
)
CORRUPTIBLE = ("attention.probe",)
"""the points whose caller spoils its own result when "corrupt" fires there"""
_hits: dict[tuple[str, str], int] = {}  # by setting: a new HF_RTP_FAULT counts from zero


def parse(spec: str) -> tuple[str, str, int | None, int]:
    """(action, point, rank or None, n) from an HF_RTP_FAULT value. A typo is an error, never a fault
    that silently never fires (a test would then pass without testing anything)."""
    match = re.fullmatch(r"(kill|stop|raise|corrupt)@([\w.]+)(?:#(\d+))?(?::(\d+))?", spec)
    if match is None:
        raise SettingError(
            f"HF_RTP_FAULT must look like 'kill@save.commit#1:2' (kill, stop, raise or corrupt), got {spec!r}"
        )
    action, where, rank, nth = match.groups()
    if where not in POINTS:
        raise SettingError(f"HF_RTP_FAULT names no fault point {where!r}; the points are {', '.join(POINTS)}")
    if action == "corrupt" and where not in CORRUPTIBLE:
        raise SettingError(
            f"HF_RTP_FAULT: {where!r} computes no result to corrupt; 'corrupt' acts at {', '.join(CORRUPTIBLE)}"
        )
    return action, where, None if rank is None else int(rank), int(nth or 1)


def check() -> None:
    """Validate HF_RTP_FAULT once, up front (from_pretrained calls it)."""
    if os.environ.get("HF_RTP_FAULT"):
        parse(os.environ["HF_RTP_FAULT"])


def point(name: str) -> bool:
    """Take the fault HF_RTP_FAULT sets at `name`, if it fires here now; True when it is "corrupt" (the caller
    then spoils its result), else False."""
    spec = os.environ.get("HF_RTP_FAULT")
    if not spec:
        _hits.clear()  # the same fault set again later counts from zero, once a point was reached while unset
        return False
    assert name in POINTS, name
    action, where, rank, nth = parse(spec)
    if where != name or (rank is not None and rank != int(os.environ.get("RANK", 0))):
        return False
    _hits[spec, name] = _hits.get((spec, name), 0) + 1
    if _hits[spec, name] != nth:
        return False
    if action == "corrupt":
        return True
    if action == "raise":
        raise OSError(28, f"No space left on device (injected by HF_RTP_FAULT at {name})")
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    return False  # SIGSTOP: continued later
