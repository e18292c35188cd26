"""hf_rtp/folders/commit.py, save_pretrained's commit into the user's folder, on real files in one process.

A commit interrupted half-way (HF_RTP_FAULT="raise@save.commit.mid", the project's own fault point) leaves no
entry point and a journal, a first save's into a folder without a checkpoint too, and `recover` (or the next save)
finishes it; a file under a shard's name that no index in the folder names is never moved over. A journal that
is not hf_rtp's, a planted one, a staging folder whose marker names another save, or any file whose identity
changed since the journal was written is never acted on: every file under the folder is byte-identical
afterwards, and the warning says why."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from support.folders import snapshot

from hf_rtp import faults
from hf_rtp.folders.commit import (
    INDEX_NAME,
    JOURNAL,
    MARKER,
    SINGLE_NAME,
    FilesInFolder,
    Refused,
    _read_journal,
    commit,
    finish_interrupted,
    lock,
    new_staging,
    own_name,
    recover,
    remove_staging,
)

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
STRAY = "model-00003-of-00003.safetensors"  # shard-named, but no index of the folder names it: the user's


def _write(path, text: str) -> None:
    Path(path).write_text(text)


def _old_sharded(folder: Path) -> None:
    """An earlier sharded save, committed into the folder beside the user's own files."""
    folder.mkdir()
    _write(folder / "tokenizer.json", "the user's tokenizer")
    _write(folder / STRAY, "the user's file under a shard's name")
    staging = new_staging(str(folder))
    _write(os.path.join(staging, "config.json"), '{"old": true}')
    _write(os.path.join(staging, INDEX_NAME), json.dumps({"weight_map": {"a": SHARD_1, "b": SHARD_2}}))
    _write(os.path.join(staging, SHARD_1), "old shard 1")
    _write(os.path.join(staging, SHARD_2), "old shard 2")
    commit(staging, str(folder), [SHARD_1, SHARD_2])
    assert _contents(folder) == {
        "config.json": '{"old": true}',
        INDEX_NAME: json.dumps({"weight_map": {"a": SHARD_1, "b": SHARD_2}}),
        SHARD_1: "old shard 1",
        SHARD_2: "old shard 2",
        "tokenizer.json": "the user's tokenizer",
        STRAY: "the user's file under a shard's name",
    }


def _staged_single(folder: Path) -> str:
    staging = new_staging(str(folder))
    _write(os.path.join(staging, "config.json"), '{"new": true}')
    _write(os.path.join(staging, SINGLE_NAME), "new weights")
    return staging


AFTER = {
    "config.json": '{"new": true}',
    SINGLE_NAME: "new weights",
    STRAY: "the user's file under a shard's name",
    "tokenizer.json": "the user's tokenizer",
}


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def test_a_commit_replaces_the_old_save_and_removes_only_the_shards_its_index_named(tmp_path):
    folder = tmp_path / "out"
    _old_sharded(folder)
    commit(_staged_single(folder), str(folder), [SINGLE_NAME])
    assert _contents(folder) == AFTER  # no journal, no staging folder, no old index or shards left


def test_a_first_commit_into_an_empty_folder_moves_the_files_in(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    commit(_staged_single(folder), str(folder), [SINGLE_NAME])
    assert _contents(folder) == {"config.json": '{"new": true}', SINGLE_NAME: "new weights"}


@pytest.fixture
def interrupted(tmp_path, monkeypatch) -> Path:
    """A commit of a single-file save over a sharded one, failed between its two moves (the fault point
    raises as a full disk would), then the fault setting gone again."""
    folder = tmp_path / "out"
    _old_sharded(folder)  # its commit reaches the fault points unset: the setting below counts from zero again
    staging = _staged_single(folder)
    monkeypatch.setenv("HF_RTP_FAULT", "raise@save.commit.mid")
    with pytest.raises(OSError, match="No space left on device"):
        commit(staging, str(folder), [SINGLE_NAME])
    monkeypatch.delenv("HF_RTP_FAULT")
    return folder


def _staging(folder: Path) -> Path:
    (staging,) = folder.glob(".hf_rtp-staging-*")
    return staging


def test_an_interrupted_commit_leaves_no_entry_point_and_recover_finishes_it(interrupted, caplog):
    names = set(os.listdir(interrupted))
    assert JOURNAL in names and INDEX_NAME not in names and SINGLE_NAME not in names  # no loader reads a mix
    assert (interrupted / "config.json").read_text() == '{"new": true}'  # the first half was moved
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        recover(str(interrupted))
    assert _contents(interrupted) == AFTER
    assert f"finished the interrupted save in {interrupted}" in caplog.text
    recover(str(interrupted))  # no journal: nothing to do
    assert _contents(interrupted) == AFTER


def test_a_shard_rewritten_after_the_journal_is_left_in_place_when_the_commit_finishes(interrupted):
    _write(interrupted / SHARD_1, "the user's newer bytes, same name")
    recover(str(interrupted))
    assert _contents(interrupted) == {**AFTER, SHARD_1: "the user's newer bytes, same name"}


def _not_hf_rtps_format(folder: Path) -> None:
    """A journal as an archive or an older hf_rtp brings it along, naming the folder itself as staging."""
    (folder / JOURNAL).unlink()
    _write(folder / JOURNAL, json.dumps({"staging": ".", "files": [SINGLE_NAME]}))


def _marker_of_another_save(folder: Path) -> None:
    marker = _staging(folder) / MARKER
    marker.unlink()
    _write(marker, json.dumps({"hf_rtp_save": "f" * 32}))


def _staging_replaced_by_a_link(folder: Path) -> None:
    """The staging folder's name now a link to a copy elsewhere, marker and all (planted)."""
    staging = _staging(folder)
    elsewhere = shutil.move(str(staging), str(folder.parent / "elsewhere"))
    staging.symlink_to(elsewhere)


def _config_rewritten(folder: Path) -> None:
    (folder / "config.json").unlink()
    _write(folder / "config.json", '{"newer": "a vanilla save since"}')


def _entry_point_written(folder: Path) -> None:
    _write(folder / SINGLE_NAME, "a newer vanilla save's weights")


def _staged_file_changed(folder: Path) -> None:
    _write(_staging(folder) / SINGLE_NAME, "other bytes in the staged file")


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_not_hf_rtps_format, "is not a journal this version of hf_rtp wrote"),
        (_marker_of_another_save, "its marker names another save"),
        (_staging_replaced_by_a_link, "it is not a folder of its own (a link, or a file)"),
        (_config_rewritten, "config.json was written after hf_rtp's interrupted save began"),
        (_entry_point_written, "model.safetensors was written after hf_rtp's interrupted save began"),
        (_staged_file_changed, "is not the file hf_rtp staged"),
    ],
)
def test_a_journal_the_folder_does_not_match_is_never_acted_on(interrupted, tamper, reason, caplog):
    tamper(interrupted)
    root = interrupted.parent
    before = snapshot(root)
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        recover(str(interrupted))  # a load: a warning, nothing touched
    assert snapshot(root) == before
    assert f"hf_rtp did not touch {interrupted}" in caplog.text and reason in caplog.text
    with lock(str(interrupted)), pytest.raises(Refused, match=r"delete \.hf_rtp-commit\.json"):
        finish_interrupted(str(interrupted))  # a save: an error that says what to delete
    assert snapshot(root) == before


def test_a_journal_found_while_another_save_holds_the_folder_is_left_to_it(interrupted, caplog):
    before = snapshot(interrupted.parent)
    with lock(str(interrupted)), caplog.at_level(logging.WARNING, logger="hf_rtp"):
        held = snapshot(interrupted.parent)
        recover(str(interrupted))
        assert snapshot(interrupted.parent) == held
    assert f"pid {os.getpid()}" in caplog.text and "is saving into" in caplog.text
    assert snapshot(interrupted.parent) == before


# --- a first save into a folder without a checkpoint: journaled like any other


def _staged_sharded(staging: str, tag: str, count: int = 2) -> list[str]:
    """A sharded save's files in `staging`, each holding `tag`; the shards' names."""
    shards = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    _write(os.path.join(staging, "config.json"), json.dumps({"tag": tag}))
    _write(os.path.join(staging, INDEX_NAME), json.dumps({"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    for shard in shards:
        _write(os.path.join(staging, shard), f"{tag} {shard}")
    return shards


def _first_save(tag: str) -> dict[str, str]:
    return {
        "config.json": json.dumps({"tag": tag}),
        INDEX_NAME: json.dumps({"weight_map": {"w0": SHARD_1, "w1": SHARD_2}}),
        SHARD_1: f"{tag} {SHARD_1}",
        SHARD_2: f"{tag} {SHARD_2}",
        "tokenizer.json": "the user's tokenizer",
    }


@pytest.fixture
def interrupted_first(tmp_path, monkeypatch) -> Path:
    """A first sharded save into a folder holding only the user's tokenizer, its commit failed half-way (the
    config and the first shard moved in, the second shard and the index not), then the fault setting gone."""
    folder = tmp_path / "out"
    folder.mkdir()
    _write(folder / "tokenizer.json", "the user's tokenizer")
    staging = new_staging(str(folder))
    shards = _staged_sharded(staging, "first")
    monkeypatch.delenv("HF_RTP_FAULT", raising=False)
    faults.point("save.commit.mid")  # reached unset: the setting below counts from zero, whatever ran before
    monkeypatch.setenv("HF_RTP_FAULT", "raise@save.commit.mid")
    with pytest.raises(OSError, match="No space left on device"):
        commit(staging, str(folder), shards)
    monkeypatch.delenv("HF_RTP_FAULT")
    return folder


def test_a_first_commit_interrupted_half_way_leaves_its_journal_and_recover_finishes_it(interrupted_first, caplog):
    names = set(os.listdir(interrupted_first))
    assert SHARD_1 in names and not {SHARD_2, INDEX_NAME, SINGLE_NAME} & names  # a shard in place, no entry point
    assert JOURNAL in names  # the proof that the shard in place is hf_rtp's, and of what is left to move
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        recover(str(interrupted_first))
    assert _contents(interrupted_first) == _first_save("first")
    assert f"finished the interrupted save in {interrupted_first}" in caplog.text


def test_the_save_after_an_interrupted_first_commit_finishes_it_then_replaces_it_whole(interrupted_first, caplog):
    target = FilesInFolder(str(interrupted_first), [SHARD_1, SHARD_2])  # save_pretrained's steps (checkpoint/save.py)
    held = target.lock()
    try:
        with caplog.at_level(logging.INFO, logger="hf_rtp"):
            staging = target.stage()  # finishes the interrupted commit first: its shard is then the index's
        assert {n: (interrupted_first / n).read_text() for n in _first_save("first")} == _first_save("first")
        assert f"finished the interrupted save in {interrupted_first}" in caplog.text
        _staged_sharded(staging, "second")
        target.commit(staging)  # over a checkpoint whose index names the shards it replaces
    finally:
        held.release()
    assert _contents(interrupted_first) == _first_save("second")


def _a_stray_shard_in_a_folder_without_a_checkpoint(folder: Path) -> str:
    """What a commit interrupted before every commit was journaled left, or whose journal was deleted by hand."""
    folder.mkdir()
    _write(folder / "tokenizer.json", "the user's tokenizer")
    _write(folder / "config.json", '{"left": "over"}')
    _write(folder / "model-00002-of-00003.safetensors", "no index names this file")
    return "model-00002-of-00003.safetensors"


def _a_stray_shard_beside_an_old_checkpoint(folder: Path) -> str:
    _old_sharded(folder)  # its index names two shards; the user's STRAY, under a third shard's name, it does not
    return STRAY


@pytest.mark.parametrize(
    "make", [_a_stray_shard_in_a_folder_without_a_checkpoint, _a_stray_shard_beside_an_old_checkpoint]
)
def test_a_shard_is_never_moved_over_a_file_no_index_in_the_folder_names(tmp_path, make):
    folder = tmp_path / "out"
    stray = make(folder)
    before = snapshot(tmp_path)
    target = FilesInFolder(str(folder), [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)])
    held = target.lock()  # save_pretrained's steps: a refused commit is abandoned, its staging folder removed
    try:
        staging = target.stage()
        _staged_sharded(staging, "new", count=3)
        with pytest.raises(Refused, match=rf"{folder} holds {stray} under the names this save's shards take"):
            target.commit(staging)
        target.abandon(staging)
    finally:
        held.release()
    assert snapshot(tmp_path) == before  # no journal, nothing moved, set aside or removed


# --- the journal's own checks: only what this version of hf_rtp writes is read as a journal

ID = "0123456789abcdef0123456789abcdef"
IDENT = [0o100000, 1, 2, 3]


def _valid() -> dict:
    return {
        "format": "hf_rtp-commit/2",
        "save_id": ID,
        "staging": ".hf_rtp-staging-" + ID,
        "entry": INDEX_NAME,
        "moves": {INDEX_NAME: {"new": IDENT, "old": None}, SHARD_1: {"new": IDENT, "old": IDENT}},
        "aside": {SINGLE_NAME: IDENT},
        "remove": {SHARD_2: IDENT},
    }


def _with(**change):
    return lambda: {**_valid(), **change}


@pytest.mark.parametrize(
    "record",
    [
        _with(format="hf_rtp-commit/1"),
        _with(save_id="../../etc"),
        _with(staging="."),
        _with(staging=".hf_rtp-staging-" + "f" * 32),  # another save's staging folder
        _with(entry="config.json"),
        _with(moves={"tokenizer.json": {"new": IDENT, "old": None}}),  # not a name save_pretrained writes
        _with(moves={SINGLE_NAME: {"new": [1, 2, 3], "old": None}}),  # not an identity
        _with(moves={SINGLE_NAME: {"new": IDENT, "old": "x"}}),
        _with(aside={"config.json": IDENT}),  # only entry points are set aside
        _with(remove={"tokenizer.json": IDENT}),  # only shards are removed
        _with(remove={SHARD_2: None}),
        lambda: {k: v for k, v in _valid().items() if k != "moves"},
        lambda: [_valid()],
        lambda: {**_valid(), "moves": [INDEX_NAME]},
    ],
)
def test_a_record_this_version_did_not_write_is_refused(tmp_path, record):
    _write(tmp_path / JOURNAL, json.dumps(_valid()))
    assert _read_journal(str(tmp_path)) == _valid()  # the unchanged record reads
    (tmp_path / JOURNAL).unlink()
    _write(tmp_path / JOURNAL, json.dumps(record()))
    with pytest.raises(Refused, match="is not a journal this version of hf_rtp wrote"):
        _read_journal(str(tmp_path))


def test_a_journal_that_is_a_link_a_fifo_not_json_or_huge_is_refused_unread(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    _write(elsewhere, json.dumps(_valid()))
    cases = {
        "link": lambda p: p.symlink_to(elsewhere),
        "fifo": lambda p: os.mkfifo(p),  # opened without blocking, refused as not a regular file
        "text": lambda p: _write(p, "not json"),
        "huge": lambda p: _write(p, " " * (1 << 20) + "{}"),
    }
    for why, make in cases.items():
        folder = tmp_path / why
        folder.mkdir()
        make(folder / JOURNAL)
        with pytest.raises(Refused, match="commit journal"):
            _read_journal(str(folder))


@pytest.mark.parametrize(
    "name, own",
    [
        (SINGLE_NAME, True),
        (INDEX_NAME, True),
        ("config.json", True),
        ("generation_config.json", True),
        ("model-00012-of-00345.safetensors", True),
        ("model-1-of-2.safetensors", False),
        ("adapter_model.safetensors", False),
        ("tokenizer.json", False),
        ("../model.safetensors", False),
        ("model.safetensors.bak", False),
    ],
)
def test_only_names_save_pretrained_writes_are_ever_staged_moved_or_removed(name, own):
    assert own_name(name) is own


def test_a_staging_folder_is_removed_only_when_provably_hf_rtps_and_holding_only_a_saves_files(tmp_path, caplog):
    clean = new_staging(str(tmp_path))
    assert oct(os.stat(clean).st_mode & 0o777) == "0o700"
    assert json.loads(Path(clean, MARKER).read_text()) == {"hf_rtp_save": os.path.basename(clean).rsplit("-", 1)[1]}
    _write(os.path.join(clean, SINGLE_NAME), "staged")
    remove_staging(clean)
    assert not os.path.lexists(clean)

    with_users_file = new_staging(str(tmp_path))
    _write(os.path.join(with_users_file, "notes.txt"), "the user's")
    users_own = tmp_path / ".hf_rtp-staging-users"  # a staging-like name without a save id
    users_own.mkdir()
    _write(users_own / SINGLE_NAME, "the user's")
    before = snapshot(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        remove_staging(with_users_file)
        remove_staging(str(users_own))
    assert snapshot(tmp_path) == before
    assert "it holds notes.txt, which a save does not stage" in caplog.text
    assert "its name does not carry a save id" in caplog.text
