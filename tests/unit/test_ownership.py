"""hf_rtp/folders/ownership.py on real files: identities that a rewrite or a planted link changes, JSON reads that
never block or grow, writes that never replace, removals of only what still matches, and one writer per folder."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path

import pytest
from support.folders import snapshot

from hf_rtp.errors import CheckpointError
from hf_rtp.folders.ownership import (
    FolderLock,
    identity,
    is_real_dir,
    read_json,
    remove_files,
    remove_folder,
    write_json,
)


def test_an_identity_changes_when_the_file_is_replaced_or_a_link_is_planted_in_its_place(tmp_path):
    path = tmp_path / "model.safetensors"
    assert identity(str(path)) is None
    path.write_text("saved")
    first = identity(str(path))
    assert first[0] == stat.S_IFREG and first[2] == len("saved")
    assert identity(str(path)) == first  # nothing changed: the same identity
    path.unlink()
    path.write_text("other")  # same name and size, another file
    assert identity(str(path)) != first
    target = tmp_path / "elsewhere"
    target.write_text("saved")
    path.unlink()
    path.symlink_to(target)
    assert identity(str(path))[0] == stat.S_IFLNK  # the link itself, not what it points to


def test_only_a_directory_that_is_not_a_link_is_a_real_one(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "f").write_text("")
    assert is_real_dir(str(tmp_path / "d"))
    assert not any(is_real_dir(str(tmp_path / n)) for n in ("link", "f", "absent"))


def test_read_json_reads_a_regular_file_and_refuses_the_rest_naming_it(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(str(good), "a test file") == {"a": [1, 2]}
    (tmp_path / "link.json").symlink_to(good)
    assert read_json(str(tmp_path / "link.json"), "a test file") == {"a": [1, 2]}  # links followed by default
    os.mkfifo(tmp_path / "fifo.json")  # no writer: a blocking open would wait forever
    (tmp_path / "big.json").write_text(" " * 100 + "{}")
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    refused = {
        "link.json": ("is a symbolic link; refusing to follow it", dict(follow_links=False)),
        "fifo.json": ("is not a regular file", {}),
        "big.json": ("has 102 bytes, more than the 64", dict(limit=64)),
        "bad.json": ("is not valid JSON", {}),
        "deep.json": ("is not valid JSON", {}),
        "absent.json": ("cannot open", {}),
        ".": ("is not a regular file", {}),
    }
    for name, (message, options) in refused.items():
        with pytest.raises(CheckpointError, match=message) as caught:
            read_json(str(tmp_path / name), "a test file", **options)
        assert "(a test file)" in str(caught.value)


def test_write_json_writes_a_new_file_whole_and_never_replaces_one(tmp_path):
    path = tmp_path / "marker.json"
    write_json(str(path), {"hf_rtp_save": "x"})
    assert json.loads(path.read_text()) == {"hf_rtp_save": "x"}
    assert os.listdir(tmp_path) == ["marker.json"]  # no temporary file left behind
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")  # a dangling link: also refused
    for existing in ("marker.json", "link.json"):
        before = snapshot(tmp_path)
        with pytest.raises(CheckpointError, match="already exists"):
            write_json(str(tmp_path / existing), {"other": 1})
        assert snapshot(tmp_path) == before


def test_removals_take_only_regular_files_that_still_match_and_keep_the_folder_if_anything_else_is_there(tmp_path):
    folder = tmp_path / "staging"
    folder.mkdir()
    for name in ("a", "b", "c"):
        (folder / name).write_text(name)
    (folder / "link").symlink_to(tmp_path)
    recorded = {n: identity(str(folder / n)) for n in ("a", "b", "c")}
    (folder / "b").unlink()
    (folder / "b").write_text("rewritten since it was recorded")
    kept = remove_files(str(folder), ["a", "b", "link", "absent"], expected=recorded)
    assert kept == ["b", "link"]
    assert sorted(os.listdir(folder)) == ["b", "c", "link"]
    assert remove_folder(str(folder), ["c"]) == ["b", "link"]  # the folder stays: it is not empty
    assert folder.is_dir()
    assert remove_folder(str(folder), ["b"], expected={"b": identity(str(folder / "b"))}) == ["link"]
    (folder / "link").unlink()
    assert remove_folder(str(folder), []) == []
    assert not folder.exists()


def test_one_writer_per_folder_a_second_is_refused_naming_the_holder(tmp_path):
    path = str(tmp_path / ".hf_rtp-save.lock")
    with FolderLock(path, "the folder out"):
        record = json.loads(Path(path).read_text())
        assert record["hf_rtp_lock"] and record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert abs(record["since"] - time.time()) < 3600
        with pytest.raises(CheckpointError, match=f"another process \\(pid {os.getpid()} on .*\\) is saving into"):
            FolderLock(path, "the folder out").acquire()  # its own open file: flock refuses it too
    assert not os.path.lexists(path)  # released: the lock file is gone
    with FolderLock(path, "the folder out"):  # and it can be taken again
        pass


def test_a_lock_file_left_by_a_killed_holder_is_taken_over(tmp_path):
    path = tmp_path / ".hf_rtp-save.lock"
    path.write_text(json.dumps({"hf_rtp_lock": True, "pid": 1, "host": "gone", "since": 0}))  # no flock held
    with FolderLock(str(path), "the folder"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_file_or_link_at_the_lock_path_that_hf_rtp_did_not_write_is_refused_untouched(tmp_path):
    (tmp_path / "users.lock").write_text("the user's")
    (tmp_path / "victim").write_text("not a lock")
    (tmp_path / "link.lock").symlink_to(tmp_path / "victim")
    (tmp_path / "dir.lock").mkdir()
    before = snapshot(tmp_path)
    for name in ("users.lock", "link.lock", "dir.lock"):
        with pytest.raises(CheckpointError, match=r"is not hf_rtp's lock file|was not written by hf_rtp"):
            FolderLock(str(tmp_path / name), "the folder").acquire()
    assert snapshot(tmp_path) == before
    with pytest.raises(CheckpointError, match="cannot create the lock"):
        FolderLock(str(tmp_path / "absent" / "x.lock"), "a missing folder").acquire()
