"""Waiting on point-to-point and collective work with an error that says what was waited for."""

from __future__ import annotations

from collections.abc import Callable

from ...errors import CollectiveMisuseError

WAITED = "waited for its ring neighbour"
"""what a failed wait says was waited for, where the caller names nothing more precise"""


class Pending:
    """Communication in flight; `wait` names a failure as CollectiveMisuseError instead of gloo/NCCL's words, then
    runs `after` (the ring's: a staged message copied to the device, a watched hop's header compared)."""

    __slots__ = ("_after", "_failed", "_what", "_works")  # one per hop: made and read thousands of times a step

    def __init__(
        self,
        works,
        what: str = WAITED,
        after: Callable[[], object] | None = None,
        failed: Callable[[], object] | None = None,
    ):
        """`failed`: called when a wait fails, before the error here is raised: a watched ring's
        (distributed/transport/watch.py) raises the failure its watch already named instead."""
        self._works, self._what, self._after, self._failed = works, what, after, failed

    def wait(self) -> None:
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as err:  # gloo/NCCL say "timed out" or "connection closed", never why
            if self._failed is not None:
                self._failed()
            raise CollectiveMisuseError(
                f"a rotated layer {self._what} past hf_rtp's timeout (HF_RTP_TIMEOUT) or lost a rank: "
                "some rank stopped, crashed, or skipped a forward or backward that every rank must run "
                f"({type(err).__name__}: {err})"
            ) from err
        if self._after is not None:
            self._after()
