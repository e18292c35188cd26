"""save_pretrained's commit into a folder that is the user's: staged, journaled, finished or left alone.

The folder may hold other files (a tokenizer, checkpoint-* folders, the user's own), so it cannot be
swapped; its files are. The writer, holding the folder's lock (ownership.FolderLock):

1. stages the new files in `.hf_rtp-staging-<save id>`, beside a marker that records the id;
2. refuses, touching nothing, where a file under the name of one of its shards is one no index in the
   folder names (the user's own, or what a save interrupted without a journal left); then writes the
   journal, for every commit, a first save's into a folder without a checkpoint too: the save id, and the
   identity (inode, size, mtime) of every file it will move in, replace, set aside or remove;
3. sets the old entry point aside into the staging folder: a loader in the window finds no entry
   point (an error), never old and new files mixed;
4. moves the files in, the new entry point last; removes the old index's shards the new save does
   not use; removes the journal, then its staging folder (a crash between the two leaves
   only a staging folder, which the next save removes once its marker proves it hf_rtp's).

A crash in 3-4 leaves the journal (so a crash never leaves files under a save's names without the
proof that hf_rtp wrote them), and the next hf_rtp load or save of the folder finishes the commit
(`recover`), but only when the folder still holds exactly what the crash left: the journal is a
regular file in hf_rtp's format, its staging folder a real child folder whose marker holds the same
id, and every file the rest of the commit would touch has the identity the journal recorded. A
journal that fails any check (copied in by an archive, planted, or stale because a newer save,
vanilla or not, has since written the folder) is never acted on: a warning (on load) or an error
(on save) names it, and nothing is deleted, moved or overwritten.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Sequence

import torch.distributed as dist

from .. import faults
from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError
from ..log import logger
from .atomic import fsync_dir, fsync_tree
from .ownership import FolderLock, identity, is_real_dir, read_json, remove_files, remove_folder, write_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
JOURNAL = ".hf_rtp-commit.json"
STAGING_PREFIX = ".hf_rtp-staging-"
MARKER = ".hf_rtp-save.json"
LOCK = ".hf_rtp-save.lock"
ASIDE = ".old"
_FORMAT = "hf_rtp-commit/2"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_ID = re.compile(r"[0-9a-f]{32}")


def own_name(name: str) -> bool:
    """A name save_pretrained writes: only such files are ever staged, moved or removed."""
    return name in (SINGLE_NAME, INDEX_NAME, "config.json", "generation_config.json") or bool(_SHARD.fullmatch(name))


class Refused(CheckpointError):
    """The folder does not hold what hf_rtp's journal recorded: nothing was touched."""


def lock(directory: str) -> FolderLock:
    return FolderLock(os.path.join(directory, LOCK), directory)


def new_staging(directory: str) -> str:
    """An empty staging folder of this save, named by a fresh id that its marker records too."""
    save_id = secrets.token_hex(16)
    staging = os.path.join(directory, STAGING_PREFIX + save_id)
    os.mkdir(staging, 0o700)
    write_json(os.path.join(staging, MARKER), {"hf_rtp_save": save_id})
    return staging


def remove_staging(staging: str) -> None:
    """Remove a staging folder provided it is provably hf_rtp's and holds only what a save stages;
    anything else is left in place and named in a warning."""
    name = os.path.basename(staging)
    reason = _not_own_staging(staging, name[len(STAGING_PREFIX) :])
    if reason is None:
        inside = os.listdir(staging)
        foreign = [n for n in inside if n != MARKER and not own_name(n)]
        reason = f"it holds {', '.join(sorted(foreign)[:5])}, which a save does not stage" if foreign else None
    if reason is None:
        left = remove_folder(staging, [n for n in inside if n != MARKER] + [MARKER])
        reason = f"{', '.join(left)} could not be removed" if left else None
    if reason is not None:
        logger.warning(f"hf_rtp left {staging} in place: {reason}. Remove it yourself if it is not needed")


def _not_own_staging(staging: str, save_id: str) -> str | None:
    """Why `staging` is not provably the staging folder of save `save_id`; None when it is."""
    if not _ID.fullmatch(save_id or ""):
        return "its name does not carry a save id"
    if not is_real_dir(staging):
        return "it is not a folder of its own (a link, or a file)"
    try:
        marker = read_json(os.path.join(staging, MARKER), "hf_rtp's staging marker", limit=4096, follow_links=False)
    except CheckpointError as err:
        return str(err)
    if marker != {"hf_rtp_save": save_id}:
        return "its marker names another save"
    return None


def commit(staging: str, directory: str, filenames: list[str]) -> None:
    """Move a complete staged save into `directory` (the writer holds the folder's lock)."""
    entry = INDEX_NAME if len(filenames) > 1 else SINGLE_NAME
    staged = sorted(n for n in os.listdir(staging) if n != MARKER)
    for name in list(staged):  # unchanged configs stay: a one-file re-save is then one rename
        if (
            name != entry
            and name not in filenames
            and _same_bytes(os.path.join(staging, name), os.path.join(directory, name))
        ):
            os.remove(os.path.join(staging, name))
            staged.remove(name)
    fsync_tree(staging)
    faults.point("save.commit")
    old_entries = [n for n in (INDEX_NAME, SINGLE_NAME) if identity(os.path.join(directory, n)) is not None]
    indexed = _indexed_shards(directory, old_entries)
    here = {n: identity(os.path.join(directory, n)) for n in staged}
    _refuse_strays(directory, [n for n in staged if _SHARD.fullmatch(n) and here[n] is not None and n not in indexed])
    record = {
        "format": _FORMAT,
        "save_id": os.path.basename(staging)[len(STAGING_PREFIX) :],
        "staging": os.path.basename(staging),
        "entry": entry,
        "moves": {n: {"new": identity(os.path.join(staging, n)), "old": here[n]} for n in staged},
        "aside": {n: identity(os.path.join(directory, n)) for n in old_entries},
        "remove": {
            f: identity(os.path.join(directory, f))
            for f in sorted(indexed - set(filenames))
            if identity(os.path.join(directory, f)) is not None
        },
    }
    if old_entries == [entry] and staged == [entry]:
        record["aside"] = {}  # the commit is one rename over the old entry point: never an instant without one
    # Always, a first save's into a folder without a checkpoint too: whatever a crash leaves of any commit is then
    # provably hf_rtp's, for the next load or save to finish, never files under a save's names without a proof.
    write_json(os.path.join(directory, JOURNAL), record)
    _finish(directory, record)


def _indexed_shards(directory: str, old_entries: list[str]) -> set[str]:
    """The shards the folder's index names: the old checkpoint's, which this save replaces or removes (the new
    save's own names replaced, the rest removed as vanilla removes them by name pattern alone)."""
    if INDEX_NAME not in old_entries:
        return set()
    try:
        weight_map = read_json(os.path.join(directory, INDEX_NAME), "the old index").get("weight_map", {})
        return {f for f in weight_map.values() if isinstance(f, str) and _SHARD.fullmatch(f)}
    except (CheckpointError, AttributeError):
        return set()  # an unreadable old index: its shards are no one's that hf_rtp can prove


def _refuse_strays(directory: str, strays: list[str]) -> None:
    """A file under a name this save's shards take that no index in the folder names is not provably a checkpoint's
    (the user's own, or what a save interrupted without a journal left): never moved over, named instead."""
    if strays:
        shown = ", ".join(strays[:5]) + (f" and {len(strays) - 5} more" if len(strays) > 5 else "")
        raise Refused(
            f"{directory} holds {shown} under the names this save's shards take, but no checkpoint index there names "
            "them, so hf_rtp cannot tell they are not yours (your own files, or what an interrupted save left). "
            "Nothing was changed: move them away (or delete them if you do not need them), then save again"
        )


class FilesInFolder:
    """storage.Storage for save_pretrained: a checkpoint's files committed among the user's own (the journaled
    commit above), `filenames` being the weight files the save writes (one, or the shards of an index)."""

    def __init__(self, directory: str, filenames: Sequence[str] = ()):
        self.directory, self.filenames = directory, list(filenames)

    def lock(self) -> FolderLock:
        os.makedirs(self.directory, exist_ok=True)
        return lock(self.directory).acquire()

    def stage(self) -> str:
        """Finish a commit a crash interrupted (it holds the newest complete checkpoint), refuse to save over a
        journal that cannot be proven hf_rtp's, and remove staging folders of saves killed before their commit
        (the old checkpoint stands)."""
        finish_interrupted(self.directory)
        for stale in os.listdir(self.directory):
            if stale.startswith(STAGING_PREFIX):
                remove_staging(os.path.join(self.directory, stale))
        return new_staging(self.directory)

    def commit(self, staging: str) -> None:
        commit(staging, self.directory, self.filenames)

    def abandon(self, staging: str) -> None:
        # a staging folder a journal names holds part of the new checkpoint: the next load or save finishes it
        if os.path.isdir(staging) and not os.path.lexists(os.path.join(self.directory, JOURNAL)):
            remove_staging(staging)

    def recover(self) -> None:
        recover(self.directory)


def recover_before_reading(directory: str, group=None) -> None:
    """The load's recovery step, collective (from_pretrained and Trainer's best-model load call it by name, before
    any rank reads `directory`): global rank 0 finishes a save_pretrained a crash interrupted there (`recover`),
    so that no rank ever reads a mix of an old and a new checkpoint. A save runs the same finish under the
    folder's lock before it stages (`finish_interrupted`). Every rank raises if rank 0 failed."""
    with agreed(group, CheckpointError):
        if not dist.is_initialized() or dist.get_rank() == 0:
            FilesInFolder(directory).recover()


def recover(directory: str) -> None:
    """On load: finish a commit a crash interrupted, when the folder provably holds what it left. Nothing
    to do without a journal; any doubt, or another save holding the folder, leaves it as it is, with a
    warning that says why."""
    if identity(os.path.join(directory, JOURNAL)) is None:
        return
    try:
        with lock(directory):
            finish_interrupted(directory)
    except CheckpointError as err:
        logger.warning(f"hf_rtp did not touch {directory}: {err}")
    except OSError as err:  # a read-only folder, say: the journal stays for a load that can write
        logger.warning(f"hf_rtp could not finish the interrupted save in {directory}: {err}")


def finish_interrupted(directory: str) -> None:
    """Under the folder's lock (a save's first step, and the load's through `recover`): finish an interrupted
    commit, or raise Refused without touching anything. Logged, as the one time hf_rtp moves files it did not
    write in this call."""
    if identity(os.path.join(directory, JOURNAL)) is not None:
        logger.info(f"hf_rtp found the journal of a save_pretrained a crash interrupted in {directory}: finishing it")
        _finish(directory, _read_journal(directory))
        logger.info(f"hf_rtp finished the interrupted save in {directory}: it holds that save's checkpoint whole")


def _read_journal(directory: str) -> dict:
    path = os.path.join(directory, JOURNAL)
    try:
        record = read_json(path, "hf_rtp's commit journal", limit=1 << 20, follow_links=False)
    except CheckpointError as err:
        raise Refused(f"{err}. {_BY_HAND}") from None
    try:
        save_id = record["save_id"]
        valid = (
            record["format"] == _FORMAT
            and _ID.fullmatch(save_id)
            and record["staging"] == STAGING_PREFIX + save_id
            and record["entry"] in (SINGLE_NAME, INDEX_NAME)
            and all(
                own_name(n) and _ident(m["new"]) and (m["old"] is None or _ident(m["old"]))
                for n, m in record["moves"].items()
            )
            and all(n in (SINGLE_NAME, INDEX_NAME) and _ident(i) for n, i in record["aside"].items())
            and all(_SHARD.fullmatch(n) and _ident(i) for n, i in record["remove"].items())
        )
    except (KeyError, TypeError, AttributeError):
        valid = False
    if not valid:
        raise Refused(f"{path} is not a journal this version of hf_rtp wrote. {_BY_HAND}")
    return record


def _ident(value) -> bool:
    return isinstance(value, list) and len(value) == 4 and all(isinstance(x, int) for x in value)


_BY_HAND = (
    "If an hf_rtp save into this folder was interrupted, check which files you want, then delete "
    ".hf_rtp-commit.json and the .hf_rtp-staging-* folder; otherwise save the model again elsewhere"
)


def _finish(directory: str, record: dict) -> None:
    """Check that every file the rest of the commit touches is as the journal recorded, then do it:
    the one path for a save's own commit and for the recovery of one a crash interrupted."""
    staging = os.path.join(directory, record["staging"])
    aside = [n for n, i in record["aside"].items() if _expect(directory, n, (i,), "set aside") is not None]
    pending = [
        n for n, m in record["moves"].items() if _expect(directory, n, (m["new"], m["old"]), "replaced") != m["new"]
    ]
    for name in (SINGLE_NAME, INDEX_NAME):  # an entry point the journal does not account for is a newer save's
        move = record["moves"].get(name, {})
        _expect(directory, name, (move.get("new"), move.get("old"), record["aside"].get(name)), "replaced")
    reason = _not_own_staging(staging, record["save_id"])  # the proof, before anything is touched
    if reason is not None:
        raise Refused(
            f"{directory} holds an interrupted save whose staging folder {record['staging']} is not usable "
            f"({reason}), so neither the old nor the new checkpoint is complete there. {_BY_HAND}"
        )
    for name in pending:
        if identity(os.path.join(staging, name)) != record["moves"][name]["new"]:
            raise Refused(f"{os.path.join(staging, name)} is not the file hf_rtp staged. {_BY_HAND}")
    if aside:
        os.makedirs(os.path.join(staging, ASIDE), exist_ok=True)
        for name in aside:
            os.replace(os.path.join(directory, name), os.path.join(staging, ASIDE, name))
        fsync_dir(directory)
    pending.sort(key=lambda n: n == record["entry"])  # the file that makes it loadable, last
    for i, name in enumerate(pending):
        if i == len(pending) // 2:
            faults.point("save.commit.mid")
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    fsync_dir(directory)
    remove_files(directory, record["remove"], expected=record["remove"])
    if is_real_dir(os.path.join(staging, ASIDE)):
        remove_folder(os.path.join(staging, ASIDE), record["aside"], expected=record["aside"])
    if identity(os.path.join(directory, JOURNAL)) is not None:
        os.remove(os.path.join(directory, JOURNAL))
    fsync_dir(directory)
    remove_staging(staging)  # last: while the journal exists, its staging folder (and marker) is its proof


def _expect(directory: str, name: str, allowed, action: str) -> list[int] | None:
    """The identity of `name` in the folder, which must be absent or one the journal recorded."""
    now = identity(os.path.join(directory, name))
    if now is not None and now not in allowed:
        raise Refused(
            f"{os.path.join(directory, name)} was written after hf_rtp's interrupted save began; finishing that save "
            f"would have {action} it. {_BY_HAND}"
        )
    return now


def _same_bytes(a: str, b: str) -> bool:
    try:
        if not stat.S_ISREG(os.lstat(b).st_mode) or os.path.getsize(a) != os.path.getsize(b):
            return False
    except FileNotFoundError:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()  # only ever config files, a few KB
