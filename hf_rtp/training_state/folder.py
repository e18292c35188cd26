"""The folder a training state goes to: one spelling per folder, the target refused unless it is absent, empty
or a training state hf_rtp wrote, and the atomic swap (folders/atomic.py) that puts a save in place or
finishes one a crash interrupted."""

from __future__ import annotations

import os

from ..errors import CheckpointError
from ..folders.atomic import recover_folder, replace_folder
from ..folders.ownership import FolderLock, is_real_dir, read_json, write_json
from .dcp_io import SHARD_FILE
from .metadata import FORMATS, STATE_FILE
from .verify import is_complete

MARKER = ".hf_rtp-state.json"  # written first into `<dir>.partial`: the folder is this save's own


def normalised(directory) -> str:
    """One spelling per folder: `~`, relative paths and trailing slashes would otherwise name siblings
    such as `ckpt/.partial` instead of `ckpt.partial`."""
    path = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.basename(path) in ("", ".", ".."):
        raise CheckpointError(f"{directory!r} cannot hold a training state: name a folder")
    return path


class StateFolder:
    """folders.storage.Storage for a training state: a folder of its own, written whole as `<directory>.partial`
    and swapped in (folders/atomic.py). `directory` is normalised: the partial's path is known on every rank,
    which all write their files into it."""

    def __init__(self, directory: str):
        self.directory = directory
        self.partial = f"{directory}.partial"

    def lock(self) -> FolderLock:
        """Beside `directory` (its parent made first)."""
        os.makedirs(os.path.dirname(self.directory), exist_ok=True)
        return FolderLock(self.directory + ".lock", self.directory).acquire()

    def stage(self) -> str:
        """The target checked, a swap a crash interrupted finished, and the partial made, marked as this save's."""
        check_target(self.directory)
        recover_folder(self.directory, is_complete, own_names, clean=True)
        if os.path.lexists(self.partial):
            raise CheckpointError(
                f"{self.partial} is in the way of this save and was not written by hf_rtp: move it away"
            )
        os.mkdir(self.partial)
        write_json(os.path.join(self.partial, MARKER), {"hf_rtp_state": True})
        return self.partial

    def commit(self, staging: str) -> None:
        replace_folder(staging, self.directory, own_names)

    def abandon(self, staging: str) -> None:
        pass  # a partial a failed save left carries its marker: the next save's `stage` removes it

    def recover(self) -> None:
        """A swap a crash interrupted: the newer complete folder put in place (nothing else is touched)."""
        directory = self.directory
        if not os.path.lexists(directory) and any(os.path.lexists(directory + s) for s in (".partial", ".old")):
            with FolderLock(directory + ".lock", directory):
                recover_folder(directory, is_complete, own_names, clean=False)


def check_target(directory: str) -> None:
    """The target is absent, empty or a training state of hf_rtp's own; anything else is refused untouched."""
    if not os.path.lexists(directory):
        return
    if os.path.islink(directory) or not os.path.isdir(directory):
        kind = "a symbolic link" if os.path.islink(directory) else "a file"
        raise CheckpointError(f"{directory} is {kind}, not a folder: pass a folder path for the training state")
    if own_names(directory) is None:
        foreign = sorted(n for n in os.listdir(directory) if not _own_name(n))
        what = f"holds {', '.join(foreign[:5])}" if foreign else f"has no {STATE_FILE} of hf_rtp's"
        raise CheckpointError(
            f"{directory} exists and {what}, which hf_rtp did not write; saving a training state there would "
            "replace the whole folder. Pass a new or empty folder (for example a checkpoint-<step> subfolder)"
        )


def _own_name(name: str) -> bool:
    return name in (STATE_FILE, MARKER) or bool(SHARD_FILE.fullmatch(name))


def own_names(folder: str) -> list[str] | None:
    """Every name in `folder` when it is provably a training state hf_rtp wrote (complete, or a partial
    one that carries its marker), or an empty folder; None otherwise."""
    if not is_real_dir(folder):
        return None
    names = sorted(os.listdir(folder))
    if not names:
        return names
    if not all(_own_name(n) for n in names):
        return None
    try:
        if MARKER in names and read_json(os.path.join(folder, MARKER), "marker", 4096, follow_links=False) == {
            "hf_rtp_state": True
        }:
            return names
        state = read_json(os.path.join(folder, STATE_FILE), "training state", follow_links=False)
    except CheckpointError:
        return None
    files = state.get("files") if isinstance(state, dict) else None
    if isinstance(state, dict) and state.get("format") in FORMATS and (files is None or isinstance(files, dict)):
        return names if files is None or set(names) <= set(files) | {STATE_FILE} else None
    return None
