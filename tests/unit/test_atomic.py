"""hf_rtp/folders/atomic.py on real folders: the target always holds the complete old or the complete new folder,
by the atomic exchange and by the fallback's two renames (HF_RTP_NO_RENAME_EXCHANGE), and a crash between those
renames (HF_RTP_FAULT="raise@state.commit.aside") is finished by `recover_folder` with the newer complete folder.
A folder `own` does not vouch for is never renamed or removed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from support.folders import snapshot

from hf_rtp.errors import CheckpointError
from hf_rtp.folders.atomic import recover_folder, replace_folder

RECORD = "record.json"  # what makes a folder one of "hf_rtp's own" in these tests, as training_state.json does


def _folder(path: Path, text: str) -> str:
    path.mkdir()
    (path / RECORD).write_text(text)
    (path / "shard.bin").write_text(text)
    return str(path)


def own(folder: str) -> list[str] | None:
    """The names to remove when `folder` is provably one of these tests' own (it holds the record), else None."""
    if not os.path.isfile(os.path.join(folder, RECORD)) or os.path.islink(folder):
        return None
    return sorted(os.listdir(folder))


def complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "shard.bin"))


def _text(folder) -> str:
    return (Path(folder) / RECORD).read_text()


@pytest.fixture(params=["exchange", "two renames"])
def way(request, monkeypatch):
    if request.param == "two renames":
        monkeypatch.setenv("HF_RTP_NO_RENAME_EXCHANGE", "1")
    return request.param


def test_replacing_leaves_the_new_folder_in_place_and_nothing_beside_it(tmp_path, way):
    target = str(tmp_path / "state")
    replace_folder(_folder(tmp_path / "state.partial", "first"), target, own)  # no target yet: a rename
    replace_folder(_folder(tmp_path / "state.partial", "second"), target, own)
    assert _text(target) == "second"
    assert os.listdir(tmp_path) == ["state"]


def test_an_old_folder_own_does_not_vouch_for_is_left_in_place_with_a_warning(tmp_path, way, caplog):
    target = tmp_path / "state"
    target.mkdir()
    (target / "notes.txt").write_text("the user's")  # no record: not provably hf_rtp's
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        replace_folder(_folder(tmp_path / "state.partial", "new"), str(target), own)
    assert _text(target) == "new"
    (left,) = (p for p in tmp_path.iterdir() if p.name != "state")
    assert (left / "notes.txt").read_text() == "the user's"
    assert f"hf_rtp left {left} in place: it was not written by hf_rtp" in caplog.text


def test_a_foreign_old_folder_in_the_fallbacks_way_is_refused_before_anything_moves(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RTP_NO_RENAME_EXCHANGE", "1")
    target = _folder(tmp_path / "state", "old")
    (tmp_path / "state.old").mkdir()
    (tmp_path / "state.old" / "draft.txt").write_text("the user's")
    _folder(tmp_path / "state.partial", "new")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"state.old is in the way of this save and it was not written by hf_rtp"):
        replace_folder(str(tmp_path / "state.partial"), target, own)
    assert snapshot(tmp_path) == before


@pytest.fixture
def crashed_between_renames(tmp_path, monkeypatch) -> Path:
    """The fallback's first rename done (old folder at .old), the second not: the target is absent."""
    target = str(tmp_path / "state")
    # an earlier save put it in place, passing the fault point unset: the setting below counts from zero again
    replace_folder(_folder(tmp_path / "state.partial", "old"), target, own)
    monkeypatch.setenv("HF_RTP_NO_RENAME_EXCHANGE", "1")
    monkeypatch.setenv("HF_RTP_FAULT", "raise@state.commit.aside")
    with pytest.raises(OSError, match="No space left on device"):
        replace_folder(_folder(tmp_path / "state.partial", "new"), target, own)
    monkeypatch.delenv("HF_RTP_FAULT")
    assert sorted(os.listdir(tmp_path)) == ["state.old", "state.partial"]  # both complete, no target
    return tmp_path


def test_recovery_puts_the_newer_complete_folder_in_place_and_drops_the_old(crashed_between_renames):
    recover_folder(str(crashed_between_renames / "state"), complete, own, clean=False)
    assert os.listdir(crashed_between_renames) == ["state"]
    assert _text(crashed_between_renames / "state") == "new"


def test_recovery_falls_back_to_the_old_folder_when_the_new_one_is_incomplete(crashed_between_renames):
    (crashed_between_renames / "state.partial" / "shard.bin").unlink()
    recover_folder(str(crashed_between_renames / "state"), complete, own, clean=False)
    assert _text(crashed_between_renames / "state") == "old"
    assert sorted(os.listdir(crashed_between_renames)) == ["state", "state.partial"]  # a load cleans nothing more
    recover_folder(str(crashed_between_renames / "state"), complete, own, clean=True)  # a save does
    assert os.listdir(crashed_between_renames) == ["state"]


def test_recovery_never_takes_a_folder_own_does_not_vouch_for(tmp_path):
    (tmp_path / "state.partial").mkdir()
    (tmp_path / "state.partial" / "shard.bin").write_text("the user's")  # complete-looking, no record
    before = snapshot(tmp_path)
    recover_folder(str(tmp_path / "state"), complete, own, clean=True)
    assert snapshot(tmp_path) == before
