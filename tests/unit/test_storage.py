"""Both ways hf_rtp saves into a user's folder follow folders/storage.py's protocol, step for step: a save
through the protocol alone leaves the target holding exactly what it staged, a failed save abandoned leaves the
old checkpoint in place, and recover on an untouched target changes nothing."""

import inspect
import os

import pytest

from hf_rtp.folders.commit import FilesInFolder
from hf_rtp.folders.storage import Storage
from hf_rtp.training_state.folder import StateFolder
from hf_rtp.training_state.metadata import STATE_FILE

_STEPS = [n for n, v in vars(Storage).items() if inspect.isfunction(v) and not n.startswith("_")]


def _files_in_folder(folder):
    return FilesInFolder(str(folder), ["model.safetensors"]), "model.safetensors"


def _state_folder(folder):
    return StateFolder(str(folder)), STATE_FILE


KINDS = pytest.mark.parametrize("make", [_files_in_folder, _state_folder], ids=["save_pretrained", "training state"])


def test_the_protocol_is_the_five_steps_and_both_kinds_take_them_with_its_signatures():
    assert _STEPS == ["lock", "stage", "commit", "abandon", "recover"]
    for kind in (FilesInFolder, StateFolder):
        for step in _STEPS:
            assert inspect.signature(getattr(kind, step)) == inspect.signature(getattr(Storage, step)), (kind, step)


def _read(target, name: str) -> str:
    with open(os.path.join(target.directory, name)) as f:
        return f.read()


def _save(target, name: str, text: str) -> None:
    held = target.lock()
    try:
        staging = target.stage()
        with open(os.path.join(staging, name), "w") as f:
            f.write(text)
        target.commit(staging)
    finally:
        held.release()


@KINDS
def test_a_save_through_the_protocol_puts_what_it_staged_in_place_and_a_second_replaces_it(tmp_path, make):
    target, name = make(tmp_path / "out")
    _save(target, name, "first")
    assert _read(target, name) == "first"
    _save(target, name, "second")
    assert _read(target, name) == "second"
    assert not [n for n in os.listdir(target.directory) if n.startswith(".hf_rtp-staging-")]
    before = sorted(os.listdir(target.directory))
    target.recover()  # nothing was interrupted: nothing changes
    assert sorted(os.listdir(target.directory)) == before


@KINDS
def test_a_failed_save_abandoned_leaves_the_old_checkpoint_and_the_next_save_goes_through(tmp_path, make):
    target, name = make(tmp_path / "out")
    _save(target, name, "old")
    held = target.lock()
    try:
        staging = target.stage()
        with open(os.path.join(staging, name), "w") as f:
            f.write("half")
        target.abandon(staging)  # the writer failed before its commit
    finally:
        held.release()
    assert _read(target, name) == "old"
    _save(target, name, "new")  # whatever the failed save left, the next one's stage clears
    assert _read(target, name) == "new"
