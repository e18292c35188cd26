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
committed), "state.commit" (about to replace the old training state). Unset, a point costs one
dictionary lookup.
"""

from __future__ import annotations

import os
import re
import signal

_hits: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get("HF_RTP_FAULT")
    if not spec:
        return
    match = re.fullmatch(r"(kill|stop|raise)@([\w.]+)(?:#(\d+))?(?::(\d+))?", spec)
    if match is None:
        raise ValueError(f"HF_RTP_FAULT must look like 'kill@save.commit#1:2', got {spec!r}")
    action, where, rank, nth = match.groups()
    if where != name or (rank is not None and int(rank) != int(os.environ.get("RANK", 0))):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    if action == "raise":
        raise OSError(28, f"No space left on device (injected by HF_RTP_FAULT at {name})")
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
