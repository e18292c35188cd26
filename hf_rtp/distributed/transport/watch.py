"""A ring's messages watched from a thread of its own, where waiting on them proves nothing (NCCL).

On NCCL `work.wait()` only orders the current stream after the transfer: it returns at once and never raises
when the peer died, stopped or skipped the walk. The host learns at its next synchronisation, which then
blocks until NCCL's watchdog aborts the process after the group's timeout, with a message about a SEND or
RECV, not about the call some rank skipped. And NCCL ignores tags, so ranks whose walks disagree would read
one kind of message as another (distributed/transport/ring.py adds a header to each hop and compares it on the device).

The watch keeps hf_rtp's promise there without a host synchronisation per hop: it holds the hops in flight
in the order they were posted (a ring's hops complete in that order, on one stream) and polls the oldest
(`is_completed()` queries a CUDA event; it does not wait). A hop still in flight past HF_RTP_TIMEOUT, or a
header that did not match, is a failure: the watch records hf_rtp's error naming it, logs it on this rank,
aborts the ring's process group (so a host synchronisation blocked on the hop returns), and the ring raises
the error at its next hop (`check`). The ring's NCCL group is made with a longer timeout than the watch's
(topology.py), so this comes first. If the script does not reach the ring again within `grace` seconds
(blocked elsewhere on the dead rank, e.g. DDP's all-reduce), the watch ends the process with that error
printed, as NCCL's watchdog would have, later and without saying why.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from ...errors import CollectiveMisuseError

logger = logging.getLogger("hf_rtp")  # log.py's, whose module reaches transformers: not for this layer
_POLL_S = 0.2  # how often the oldest hop is looked at while any is in flight: a timeout is minutes
_UNPOSTED = "still not posted (NCCL connects two ranks at their first message and waits for the neighbour)"


class Watch:
    def __init__(
        self,
        timeout_s: float,
        abort: Callable[[], None] | None = None,
        grace_s: float | None = None,
        device: torch.device | None = None,
    ):
        self.timeout_s = timeout_s
        self.device = device
        """the ring's device: the thread's CUDA calls go there (a new thread starts on GPU 0, and a CUDA call there
        would make a context on GPU 0 for every rank of a node)"""
        self.grace_s = grace_s
        """seconds after a failure before the process is ended if the ring was not reached (None: never)"""
        self._abort = abort
        self._hops: collections.deque = collections.deque()  # [posted at, works or None while posting, what]
        self._flags: list = []  # [(event or None, flag, what)]: a header mismatch seen on the device, read unwaited
        self._host: torch.Tensor | None = None  # pinned: where a CUDA flag is copied to be read
        self._lock = threading.Condition()
        self._idle = False  # the thread waits on `_lock` for work: only then does a new hop or flag notify it
        self._thread: threading.Thread | None = None
        self.failure: CollectiveMisuseError | None = None
        self._raised = False

    def begin(self, what: str) -> list:
        """A hop about to be posted, watched from now: on NCCL the post itself can block the host (a pair of ranks
        connects at its first message, and waits for the neighbour to come). `posted` gives it its works."""
        entry = [time.monotonic(), None, what]  # [posted at, works (None: still being posted), what]
        # No lock a hop: a deque's append and popleft are atomic, and the thread, before it waits for work, says so
        # (`_idle`) and looks again under the lock, so a hop appended meanwhile is seen or wakes it.
        self._hops.append(entry)
        if self._thread is None:
            with self._lock:
                self._thread = threading.Thread(target=self._run, name="hf_rtp-ring-watch", daemon=True)
                self._thread.start()
        if self._idle:
            with self._lock:
                self._lock.notify()
        return entry

    def posted(self, entry: list, works: list) -> None:
        """The works `begin`'s hop was posted as. No works (an empty hop, or a post that raised by itself) counts as
        completed: the thread pops it in turn, as it pops every entry (removing it here would race its reads). One
        item's assignment, atomic: the thread reads the entry whole or sees it still being posted."""
        entry[1] = works

    def flag(self, flag: torch.Tensor, what: str) -> None:
        """Watch `flag` (nonzero: a hop's header did not match): copied to host memory behind the work queued
        so far and read once that copy is done (a CUDA event), so nothing waits for the device. One copy in
        flight at a time: while it is, a newer flag is not copied (the flag only ever goes from 0 to 1, so the
        next one catches up)."""
        with self._lock:
            if self._flags and self._flags[0][0] is not None and not self._flags[0][0].query():
                return
        if flag.device.type == "cuda":
            if self._host is None:
                self._host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            host = self._host
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flag, None
        with self._lock:
            self._flags = [(event, host, what)]
            if self._idle:
                self._lock.notify()

    def check(self) -> None:
        """Raise the failure the watch recorded, if any (the ring calls this at every hop, and a wait that failed
        calls it first, so a script that catches the error is not ended for want of reaching the ring)."""
        if self.failure is not None:
            self._raised = True
            raise self.failure

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._watch()
        except Exception as err:  # a sticky CUDA error in a query: nothing would watch the ring any more
            self._fail(f"watching its hops failed ({type(err).__name__}: {err})")

    def _watch(self) -> None:
        since = time.monotonic()  # when the oldest hop in flight began to wait: the hop before it completed then
        while True:
            with self._lock:
                while not self._hops and not self._flags:
                    self._idle = True
                    if not self._hops and not self._flags:  # looked at again after saying so: no wake-up is lost
                        self._lock.wait(timeout=_POLL_S * 5)
                    self._idle = False
                hops, flags = self._hops, list(self._flags)
            problem = None
            for event, host, what in flags:
                if event is None or event.query():
                    with self._lock:
                        if self._flags and self._flags[0][1] is host:
                            self._flags = []
                    if bool(host.any()):
                        problem = (
                            f"ranks of the ring walked it differently: {what} brought another kind of message than "
                            "this rank expected (some rank skipped or added a forward, backward or generate step)"
                        )
            while hops and problem is None:
                posted, works, what = hops[0]
                # A work NCCL completed with an error (a peer's network link closed) is popped as done: torch's own
                # NCCL error handling ends the job then, naming a remote error. Work.exception(), which would tell,
                # logs a deprecation warning from torch in every process that calls it.
                if works is not None and all(w.is_completed() for w in works):
                    with self._lock:
                        hops.popleft()
                    since = time.monotonic()
                    continue
                # hops queue behind each other (a save posts every piece at once): each waits from the one before
                waited = time.monotonic() - max(posted, since)
                if waited > self.timeout_s:
                    state = "still in flight" if works is not None else _UNPOSTED
                    problem = (
                        f"{what} was {state} after {waited:.0f} s, past hf_rtp's timeout (HF_RTP_TIMEOUT): "
                        "its neighbour stopped, crashed, or skipped a forward or backward that every rank must run"
                    )
                break
            if problem is not None:
                self._fail(problem)
                return
            if not hops:
                since = time.monotonic()
            time.sleep(_POLL_S)

    def _fail(self, problem: str) -> None:
        self.failure = CollectiveMisuseError(f"a rotated layer's ring failed: {problem}")
        logger.error("hf_rtp: %s", self.failure)  # every rank's own: which rank saw what is the point
        if self._abort is not None:
            try:
                self._abort()  # kernels waiting on the dead peer exit; a host wait on them returns
            except Exception as err:  # an abort that fails leaves the grace below to end the process
                logger.error("hf_rtp: aborting the ring's process group failed: %s", err)
        if self.grace_s is None:
            return
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            if self._raised:
                return
            time.sleep(_POLL_S)
        print(
            f"hf_rtp: ending this process: {self.failure} (the script did not reach the ring again within "
            f"{self.grace_s:.0f} s: it is blocked on the failed rank elsewhere)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
