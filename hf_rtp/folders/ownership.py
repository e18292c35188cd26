"""Proof that hf_rtp wrote what it is about to delete, move or overwrite, and one writer per folder.

A checkpoint folder is the user's: it may hold a tokenizer, notes, other runs, or files a `git clone`
or an archive brought along, journals and links included. hf_rtp acts on a file only when it can show
it wrote it: a name of its own pattern, not a link where a file or folder is expected, and a recorded
identity (inode, size, modification time) or marker that the file still matches. Everything here
refuses rather than guesses; callers turn a refusal into a warning (leave it alone) or an error.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import time

from ..errors import CheckpointError

MAX_JSON_BYTES = 64 << 20  # a training state's JSON holds RNG states and param groups: a few MB at most


def identity(path: str) -> list[int] | None:
    """What a file is now, as far as a later check needs: [type, inode, size, mtime_ns]; None if absent.

    Links are not followed: a link planted where hf_rtp left a file never matches that file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return [stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns]


def is_real_dir(path: str) -> bool:
    """A directory that is not a symbolic link (a link could point anywhere, outside the checkpoint too)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def read_json(path: str, what: str, limit: int = MAX_JSON_BYTES, follow_links: bool = True):
    """Parse a JSON file of at most `limit` bytes; a fifo, device, link (unless followed), oversized or
    malformed file is a CheckpointError that names it. Never blocks and never grows without bound."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointError(f"{path} ({what}) is a symbolic link; refusing to follow it") from None
        raise CheckpointError(f"cannot open {path} ({what}): {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} ({what}) is not a regular file; refusing to read it")
        if st.st_size > limit:
            raise CheckpointError(f"{path} ({what}) has {st.st_size} bytes, more than the {limit} such a file needs")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} ({what}) is not valid JSON ({str(err)[:200]})") from None


def write_json(path: str, data) -> None:
    """Write a new file through a temporary name and rename: a reader sees nothing or the whole file.
    Only ever a file hf_rtp creates (a journal, a marker): an existing one is refused, never replaced."""
    if os.path.lexists(path):
        raise CheckpointError(f"{path} already exists; hf_rtp writes it only where none is")
    temporary = f"{path}.{secrets.token_hex(4)}.tmp"
    with open(temporary, "x") as f:  # "x": never through a link, never over a file someone else left there
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def remove_files(folder: str, names, expected: dict[str, list[int]] | None = None) -> list[str]:
    """Delete `names` from `folder` where each is a regular file (and, where `expected` records one, still
    has that identity). Returns the names it left in place."""
    kept = []
    for name in names:
        path = os.path.join(folder, name)
        now = identity(path)
        if now is None:
            continue
        if now[0] != stat.S_IFREG or (expected is not None and now != expected.get(name)):
            kept.append(name)
            continue
        os.remove(path)
    return kept


def remove_folder(folder: str, names, expected: dict[str, list[int]] | None = None) -> list[str]:
    """remove_files, then the folder itself if nothing else is in it. Returns what it left in place."""
    kept = remove_files(folder, names, expected)
    try:
        os.rmdir(folder)
    except OSError:
        return sorted(os.listdir(folder))
    return kept


class FolderLock:
    """One hf_rtp writer per target: an exclusive flock on a lock file of hf_rtp's own, held for the whole
    save, released by the kernel if the holder dies (so a killed save never leaves a stale lock).

    A second save fails at once with a message naming the holder, instead of the two deleting each
    other's staged files. The lock file is removed on release; a file of that name that hf_rtp did
    not write (no lock record in it), or a link, is refused, never overwritten.
    """

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        for _ in range(5):  # the previous holder may unlink the file between our open and our lock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_record(fd)
                os.close(fd)
                raise CheckpointError(
                    f"another process ({holder}) is saving into {self.what} right now; two saves into one folder "
                    "would destroy each other's files. Wait for it to finish, or save somewhere else"
                ) from None
            except OSError as err:  # ENOLCK: a filesystem without locks; say so rather than pretend
                os.close(fd)
                raise CheckpointError(
                    f"cannot lock {self.path} ({err.strerror}): this filesystem has no file locks, so hf_rtp cannot "
                    "keep two saves from writing into one folder at once. Save to a local or lock-capable filesystem"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            record = {"hf_rtp_lock": True, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.pwrite(fd, json.dumps(record).encode(), 0)
            self._fd = fd
            return self
        raise CheckpointError(f"could not take the lock {self.path}: it keeps being replaced by another process")

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        except OSError as err:  # a read-only or missing folder
            raise CheckpointError(f"cannot create the lock {self.path} for {self.what}: {err.strerror}") from None
        try:
            fd = os.open(self.path, flags)
        except OSError as err:
            raise CheckpointError(
                f"{self.path} exists and is not hf_rtp's lock file ({err.strerror}); move it away to save into "
                f"{self.what}"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode) or _lock_record(fd) == "unknown":
            os.close(fd)
            raise CheckpointError(
                f"{self.path} exists and was not written by hf_rtp; move it away to save into {self.what}"
            )
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.lstat(self.path).st_ino:
                os.remove(self.path)  # still ours: we hold its lock
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _lock_record(fd: int) -> str:
    """Who holds a lock file, from what it recorded; "unknown" when it holds no hf_rtp record."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return "unknown"
    if not isinstance(record, dict) or not record.get("hf_rtp_lock"):
        return "unknown" if record else "starting"
    return f"pid {record.get('pid')} on {record.get('host')}"
