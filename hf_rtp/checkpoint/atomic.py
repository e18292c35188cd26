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
import json
import os
import re
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
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_folder(new: str, target: str) -> None:
    """Make complete folder `new` the `target`, dropping the old one, without an instant of neither."""
    fsync_tree(new)
    faults.point("state.commit")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.exists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        shutil.rmtree(new)  # now the old one; a crash before this leaves it for recover_folder
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


# save_pretrained writes into a folder that may hold other files (a tokenizer, checkpoint-* folders),
# so the folder cannot be swapped; its files are. While they move, a journal names the staging folder
# that holds the rest of the new checkpoint, and the old entry point is set aside first: a loader
# in that window finds no entry point (an error), never old and new files mixed, and the next hf_rtp
# load or save of the folder finishes the move (`recover_save`).
JOURNAL = ".hf_rtp-commit.json"
ASIDE = ".old"


def commit_save(staging: str, directory: str, filenames: list[str]) -> None:
    """Move a complete staged save into `directory`, the file that makes it loadable last."""
    from .files import INDEX_NAME, SINGLE_NAME

    entry = INDEX_NAME if len(filenames) > 1 else SINGLE_NAME
    for name in os.listdir(staging):  # unchanged configs stay: a one-file re-save is then one rename
        if name != entry and name not in filenames and _same_bytes(os.path.join(staging, name), os.path.join(directory, name)):
            os.remove(os.path.join(staging, name))
    fsync_tree(staging)
    faults.point("save.commit")
    old_entries = [n for n in (INDEX_NAME, SINGLE_NAME) if os.path.exists(os.path.join(directory, n))]
    if old_entries and (old_entries != [entry] or os.listdir(staging) != [entry]):
        _write_json_atomically(os.path.join(directory, JOURNAL), {"staging": os.path.basename(staging), "files": filenames})
        os.mkdir(os.path.join(staging, ASIDE))
        for name in old_entries:
            os.replace(os.path.join(directory, name), os.path.join(staging, ASIDE, name))
        fsync_dir(directory)
    _finish(staging, directory, filenames)


def recover_save(directory: str) -> None:
    """Finish a save_pretrained commit that a crash interrupted; nothing to do without a journal."""
    from ..errors import CheckpointError

    journal = os.path.join(directory, JOURNAL)
    if not os.path.exists(journal):
        return
    with open(journal) as f:
        record = json.load(f)
    staging = os.path.join(directory, os.path.basename(record["staging"]))
    if not os.path.isdir(staging):
        raise CheckpointError(
            f"{directory} holds an interrupted save whose staging folder {record['staging']} is gone, so neither the old "
            "nor the new checkpoint is complete there: save the model again"
        )
    _finish(staging, directory, record["files"])


def _finish(staging: str, directory: str, filenames: list[str]) -> None:
    from .files import INDEX_NAME, SINGLE_NAME

    entry = INDEX_NAME if len(filenames) > 1 else SINGLE_NAME
    names = sorted((n for n in os.listdir(staging) if n != ASIDE), key=lambda n: n == entry)
    for i, name in enumerate(names):
        if i == len(names) // 2:
            faults.point("save.commit.mid")
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    fsync_dir(directory)
    if os.path.exists(os.path.join(directory, JOURNAL)):
        os.remove(os.path.join(directory, JOURNAL))
    for old in os.listdir(directory):  # shards only the old checkpoint used
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", old) and old not in filenames:
            os.remove(os.path.join(directory, old))
    shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(directory)


def _same_bytes(a: str, b: str) -> bool:
    if not os.path.isfile(b) or os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()  # only ever config files, a few KB


def _write_json_atomically(path: str, data: dict) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
