"""The protocol every hf_rtp save into a user's folder follows, whatever it writes: a model's weights among the
user's files (`commit.FilesInFolder`) or a training state that is a folder of its own
(`training_state.folder.StateFolder`).

A save's writer takes the steps in this order: `lock`, `stage` (what a crash interrupted is finished first, and a
fresh staging folder marked as this save's own is made), writes into the staging folder, `commit` (the staged files
take the target's place at one instant), then releases the lock; after a failure, `abandon`. A load calls
`recover` alone, before any rank reads. At every instant the target holds a complete old or a complete new
checkpoint, and every step touches only what it can prove hf_rtp wrote (ownership.py).
"""

from __future__ import annotations

from typing import Protocol

from .ownership import FolderLock


class Storage(Protocol):
    directory: str
    """the target: the folder the user named"""

    def lock(self) -> FolderLock:
        """Acquired: held from `stage` to the end of `commit` (or of the failure), one save per target at a time."""
        ...

    def stage(self) -> str:
        """Under the lock: the target checked, a save a crash interrupted finished, and an empty staging folder made,
        marked as this save's own; its path."""
        ...

    def commit(self, staging: str) -> None:
        """Under the lock: the staged files take the target's place, at one instant."""
        ...

    def abandon(self, staging: str) -> None:
        """After a failed save: what it staged removed, unless a journal still needs it to finish the commit."""
        ...

    def recover(self) -> None:
        """On load, before any read: a commit a crash interrupted finished when provably hf_rtp's; any doubt leaves
        the folder as it is, with a warning."""
        ...
