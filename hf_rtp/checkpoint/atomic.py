"""Replace a checkpoint so that at every instant the target holds the complete old or the complete new one.

Training states are folders of hf_rtp's own: the new one is written beside the target as
`<target>.partial` and the two are swapped with one renameat2(RENAME_EXCHANGE), which Linux does
atomically. Where the filesystem cannot exchange, the old folder is first renamed to `<target>.old`;
a crash between the two renames leaves both complete, and `recover_folder` (run before every load
and save) puts the newer complete one in place.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil

from .. import faults

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def fsync_tree(folder: str) -> None:
    """Flush every file of `folder` and the folder itself: a rename must never publish unwritten data."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
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
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    return False


def replace_folder(new: str, target: str) -> None:
    """Make complete folder `new` the `target`, dropping the old one, without an instant of neither."""
    fsync_tree(new)
    faults.point("state.commit")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.exists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # now the old one
    else:
        aside = target + ".old"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(target, aside)
        faults.point("state.commit.aside")
        os.rename(new, target)
        shutil.rmtree(aside)
    fsync_dir(parent)


def recover_folder(target: str, complete) -> None:
    """Undo what a crash mid-replace left: a complete `.partial` or `.old` replaces a missing target;
    leftovers beside a complete target are removed (a `.partial` never got committed)."""
    partial, aside = target + ".partial", target + ".old"
    if not os.path.exists(target):
        if os.path.isdir(partial) and complete(partial):
            os.rename(partial, target)
        elif os.path.isdir(aside):
            os.rename(aside, target)
    if os.path.isdir(target):
        for leftover in (partial, aside):
            shutil.rmtree(leftover, ignore_errors=True)
