"""What a user's folder holds, to assert that hf_rtp left it byte for byte as it was; and the hostile
things a folder can carry (a journal from an archive, links named like hf_rtp's, foreign files)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path


def snapshot(root) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): files by SHA-256, links by target, folders by name."""
    root = str(root)
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(mode):
                out[rel] = ("file", hashlib.sha256(Path(path).read_bytes()).hexdigest())
            else:
                out[rel] = ("other", stat.S_IFMT(mode))
    return out


def make_victim(folder) -> str:
    """A folder outside every checkpoint, holding files a checkpoint folder would: nothing may touch it."""
    os.makedirs(folder, exist_ok=True)
    for name, text in [("model.safetensors", "not a model, the user's"), ("config.json", "{}"), ("notes.txt", "mine")]:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return str(folder)


FAKE_ID = "0123456789abcdef0123456789abcdef"
PLANTED = ("users-notes.txt", ".hf_rtp-staging-" + FAKE_ID, ".hf_rtp-commit.json", ".hf_rtp-staging-users")


def unplanted(names) -> list[str]:
    """A listing without what plant_hostile put there."""
    return sorted(n for n in names if n not in PLANTED)


def plant_hostile(folder, victim) -> None:
    """What a git clone, an archive or a hostile user can leave in a folder under hf_rtp's names: an old
    journal whose staging is the folder itself, a journal in hf_rtp's format naming a staging folder that
    is a link to `victim` (with a forged marker there), and a staging-named folder of the user's own."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "users-notes.txt"), "w") as f:
        f.write("the user's own file")
    staging = ".hf_rtp-staging-" + FAKE_ID
    os.symlink(victim, os.path.join(folder, staging))
    with open(os.path.join(victim, ".hf_rtp-save.json"), "w") as f:
        json.dump({"hf_rtp_save": FAKE_ID}, f)
    moves = {
        name: {"new": _identity(os.path.join(victim, name)), "old": _identity(os.path.join(folder, name))}
        for name in ("model.safetensors", "config.json")
    }  # forged to match: only the link gives it away
    journal = {
        "format": "hf_rtp-commit/2",
        "save_id": FAKE_ID,
        "staging": staging,
        "entry": "model.safetensors",
        "moves": moves,
        "aside": {},
        "remove": {},
    }
    with open(os.path.join(folder, ".hf_rtp-commit.json"), "w") as f:
        json.dump(journal, f)
    own = os.path.join(folder, ".hf_rtp-staging-users")
    os.makedirs(own, exist_ok=True)
    with open(os.path.join(own, "model.safetensors"), "w") as f:
        f.write("the user's, under a name like hf_rtp's")


def _identity(path):
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    return [stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns]


def old_journal(folder, staging: str) -> None:
    """A journal in the format hf_rtp wrote before it proved ownership, naming `staging`."""
    with open(os.path.join(str(folder), ".hf_rtp-commit.json"), "w") as f:
        json.dump({"staging": staging, "files": ["model.safetensors"]}, f)
