"""Replace a folder of hf_rtp's own so that at every instant the target holds the complete old or the
complete new one.

Training states are folders of hf_rtp's own: the new one is written beside the target as
`<target>.partial` and the two are swapped with one renameat2(RENAME_EXCHANGE), which Linux does
atomically. Where the filesystem cannot exchange, the old folder is first renamed to `<target>.old`;
a crash between the two renames leaves both complete, and `recover_folder` puts the newer complete
one in place.

Nothing here decides what is hf_rtp's: the caller passes `own(folder)`, the names to remove when the
folder is provably one hf_rtp wrote, else None; a folder that is not is never renamed or removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

from .. import faults
from ..errors import CheckpointError
from ..log import logger
from .ownership import remove_folder

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
Own = Callable[[str], "list[str] | None"]


def fsync_tree(folder: str) -> None:
    """Flush every file of `folder` and the folder itself: a rename must never publish unwritten data."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the kernel, libc or filesystem cannot."""
    if os.environ.get("HF_RTP_NO_RENAME_EXCHANGE"):  # exercises the fallback where exchange exists
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_folder(new: str, target: str, own: Own) -> None:
    """Make complete folder `new` the `target` (absent, or provably hf_rtp's: the caller checked), dropping
    the old one, without an instant of neither."""
    fsync_tree(new)
    faults.point("state.commit")
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        _remove(new, own)  # now the old one; a crash before this leaves it for the next save
    else:
        aside = target + ".old"
        if os.path.lexists(aside):
            _remove(aside, own, refuse=True)
        os.rename(target, aside)
        faults.point("state.commit.aside")
        os.rename(new, target)
        _remove(aside, own)
    fsync_dir(parent)


def recover_folder(target: str, complete: Callable[[str], bool], own: Own, clean: bool) -> None:
    """Finish a replace that a crash interrupted: with the target gone, a complete `.partial` (the newer)
    or `.old` of hf_rtp's own takes its place, and the `.old` is dropped. With `clean` (before a save),
    also remove leftovers of hf_rtp's own from saves killed before their commit."""
    partial, aside = target + ".partial", target + ".old"
    if not os.path.lexists(target):
        for candidate in (partial, aside):
            if own(candidate) is not None and complete(candidate):
                os.rename(candidate, target)
                fsync_dir(os.path.dirname(target))
                break
        else:
            return
        if os.path.lexists(aside):
            _remove(aside, own)
    if clean:
        for leftover in (partial, aside):
            if os.path.lexists(leftover):
                _remove(leftover, own)


def _remove(folder: str, own: Own, refuse: bool = False) -> None:
    names = own(folder)
    left = remove_folder(folder, names) if names is not None else None
    if left == []:
        return
    why = "it was not written by hf_rtp" if left is None else f"{', '.join(left[:5])} could not be removed"
    if refuse:
        raise CheckpointError(f"{folder} is in the way of this save and {why}: move it away, then save again")
    logger.warning(f"hf_rtp left {folder} in place: {why}. Remove it yourself if it is not needed")
