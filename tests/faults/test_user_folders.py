"""A checkpoint folder is the user's: hf_rtp deletes, moves or overwrites only what it can prove it wrote.

Each case is one a realistic user (or a folder from an archive, a git clone, a Hub repo) brings
about; each asserts that the user's files are byte-identical afterwards and that hf_rtp says why
it left something alone."""

import logging
import os
import shutil

import pytest
import torch
from support.folders import make_victim, old_journal, plant_hostile, snapshot, unplanted
from support.models import make_tiny_llama, trained_one_step
from transformers import AutoModelForCausalLM

import hf_rtp

SHARDS = "12KB"  # several files, so a commit moves many


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "ckpt")


def _weights(model):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def hf_rtp_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        yield caplog


@pytest.mark.parametrize("staging", [".", "..", "/", "model.safetensors"])
def test_a_journal_from_an_archive_deletes_nothing_when_the_folder_is_loaded(ckpt, tmp_path, staging, hf_rtp_warnings):
    folder = shutil.copytree(ckpt, tmp_path / "cloned")
    (folder / "README.md").write_text("the user's")
    old_journal(folder, staging)  # as the previous hf_rtp wrote them: {"staging": ..., "files": [...]}
    before = snapshot(tmp_path)
    model = hf_rtp.from_pretrained(str(folder))
    assert snapshot(tmp_path) == before
    assert _same(_weights(model), _weights(AutoModelForCausalLM.from_pretrained(ckpt)))
    assert "is not a journal this version of hf_rtp wrote" in hf_rtp_warnings.text
    with pytest.raises(hf_rtp.CheckpointError, match=r"is not a journal this version of hf_rtp wrote.*delete"):
        model.save_pretrained(str(folder))  # a save would write over what the journal names: refused
    assert snapshot(tmp_path) == before


def test_a_journal_naming_a_linked_staging_folder_moves_nothing_in(ckpt, tmp_path, hf_rtp_warnings):
    victim = make_victim(tmp_path / "elsewhere")
    folder = tmp_path / "cloned"
    folder.mkdir()
    shutil.copy(os.path.join(ckpt, "config.json"), folder / "config.json")
    plant_hostile(folder, victim)  # journal in hf_rtp's format, staging a link to `victim` with a forged marker
    before = snapshot(tmp_path)
    with pytest.raises(hf_rtp.CheckpointError, match=r"no model.safetensors"):
        hf_rtp.from_pretrained(str(folder))  # nothing to load, and nothing moved in from outside
    assert snapshot(tmp_path) == before
    assert "not a folder of its own (a link" in hf_rtp_warnings.text


def _interrupted_then_vanilla(ckpt, folder):
    """An hf_rtp save whose commit fails half-way, then the natural fix: a vanilla save of a newer model."""
    model = hf_rtp.from_pretrained(ckpt)
    model.save_pretrained(folder, max_shard_size=SHARDS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    _save_failing_mid_commit(model, folder, max_shard_size=SHARDS)
    assert os.path.exists(os.path.join(folder, ".hf_rtp-commit.json"))
    torch.manual_seed(7)
    newer = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(ckpt).config)
    newer.save_pretrained(folder)
    return _weights(newer)


def test_a_stale_journal_never_wins_against_a_newer_save(ckpt, tmp_path, hf_rtp_warnings):
    folder = str(tmp_path / "out")
    newer = _interrupted_then_vanilla(ckpt, folder)
    before = snapshot(folder)
    loaded = hf_rtp.from_pretrained(folder)
    assert _same(_weights(loaded), newer)  # the newer save, not the interrupted older one
    assert snapshot(folder) == before  # nothing finished, moved or removed
    assert "was written after hf_rtp's interrupted save began" in hf_rtp_warnings.text
    assert _same(_weights(AutoModelForCausalLM.from_pretrained(folder)), newer)
    with pytest.raises(hf_rtp.CheckpointError, match="was written after hf_rtp's interrupted save began"):
        loaded.save_pretrained(folder)
    assert snapshot(folder) == before


def test_an_interrupted_commit_is_still_finished_when_the_folder_is_as_it_left_it(ckpt, tmp_path, caplog):
    folder = str(tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("the user's")
    model = hf_rtp.from_pretrained(ckpt)
    model.save_pretrained(folder, max_shard_size=SHARDS)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    expected = _weights(model)
    _save_failing_mid_commit(model, folder, max_shard_size="1GB")  # sharded -> single: the old shards must go
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        reloaded = hf_rtp.from_pretrained(folder)  # the load's recovery step, named in the log
    assert _same(_weights(reloaded), expected)
    assert f"found the journal of a save_pretrained a crash interrupted in {folder}: finishing it" in caplog.text
    assert f"finished the interrupted save in {folder}" in caplog.text
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "the user's"


@pytest.mark.parametrize("then", ["load", "save"])
def test_a_first_save_interrupted_mid_commit_is_journaled_and_finished_by_the_next_load_or_save(
    ckpt, tmp_path, caplog, then
):
    """A first save_pretrained into a folder without a checkpoint (the user's tokenizer only), failing half-way
    through its commit: some shards in place, no entry point. The journal proves them hf_rtp's, so the next load
    or save finishes the commit; a save then replaces that checkpoint whole."""
    folder = str(tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_text("the user's")
    model = hf_rtp.from_pretrained(ckpt)
    expected = _weights(model)
    _save_failing_mid_commit(model, folder, max_shard_size=SHARDS)
    names = os.listdir(folder)
    assert [n for n in names if n.startswith("model-")] and "model.safetensors.index.json" not in names
    assert ".hf_rtp-commit.json" in names  # the proof that those shards are hf_rtp's, and of what is left to do
    with pytest.raises(OSError, match=r"model\.safetensors"):
        AutoModelForCausalLM.from_pretrained(folder)  # vanilla finds no entry point: an error, never a part
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        if then == "load":
            assert _same(_weights(hf_rtp.from_pretrained(folder)), expected)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            expected = _weights(model)
            model.save_pretrained(folder, max_shard_size=SHARDS)
    assert f"found the journal of a save_pretrained a crash interrupted in {folder}: finishing it" in caplog.text
    assert _same(_weights(AutoModelForCausalLM.from_pretrained(folder)), expected)
    assert not [n for n in os.listdir(folder) if n.startswith(".hf_rtp")]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "the user's"


def test_a_first_save_interrupted_before_it_moved_anything_in_is_finished_by_the_next_load(ckpt, tmp_path, caplog):
    """The window right after the journal is written: no config.json in the folder yet, only the journal and the
    staging folder. Resolving the folder does not refuse it for want of a config; the load's recovery step
    finishes the commit, and the folder loads."""
    out = tmp_path / "out"
    out.mkdir()
    model = hf_rtp.from_pretrained(ckpt)
    expected = _weights(model)
    _save_failing_mid_commit(model, str(out))  # single file: config.json moved in, then the fault
    (staging,) = out.glob(".hf_rtp-staging-*")
    for name in os.listdir(out):  # back where the commit found it: a rename keeps what the journal recorded
        if not name.startswith(".hf_rtp"):
            os.rename(out / name, staging / name)
    assert sorted(os.listdir(out)) == sorted([".hf_rtp-commit.json", staging.name])
    with caplog.at_level(logging.INFO, logger="hf_rtp"):
        assert _same(_weights(hf_rtp.from_pretrained(str(out))), expected)
    assert f"finished the interrupted save in {out}" in caplog.text
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def _fresh(ckpt):
    model = hf_rtp.from_pretrained(ckpt).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_training_state_is_never_saved_over_the_users_files(ckpt, tmp_path):
    model, optimizer = trained_one_step(ckpt)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    shutil.copytree(ckpt, run / "final")
    before = snapshot(tmp_path)
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"run exists and holds final, metrics.jsonl, which hf_rtp did not write"
    ):
        hf_rtp.save_training_state(str(run), model, optimizer)
    assert snapshot(tmp_path) == before
    hf_rtp.save_training_state(str(run / "checkpoint-1"), model, optimizer)  # what the message suggests
    hf_rtp.save_training_state(str(run / "checkpoint-1"), model, optimizer)  # and over its own: replaced
    assert {k: v for k, v in snapshot(tmp_path).items() if "checkpoint-1" not in k} == before


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_training_state_target_that_is_a_file_or_a_link_is_refused_untouched(ckpt, tmp_path, kind):
    model, optimizer = trained_one_step(ckpt)
    target = tmp_path / "ckpt-state"
    if kind == "file":
        target.write_text("the user's")
    else:
        make_victim(tmp_path / "elsewhere")
        target.symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    with pytest.raises(
        hf_rtp.CheckpointError, match=f"ckpt-state is a {'file' if kind == 'file' else 'symbolic link'}, not a folder"
    ):
        hf_rtp.save_training_state(str(target), model, optimizer)
    assert snapshot(tmp_path) == before


def test_a_foreign_partial_folder_in_the_way_is_refused_untouched(ckpt, tmp_path):
    model, optimizer = trained_one_step(ckpt)
    (tmp_path / "state.partial").mkdir()
    (tmp_path / "state.partial" / "draft.txt").write_text("the user's")
    before = snapshot(tmp_path)
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"state.partial is in the way of this save and was not written by hf_rtp"
    ):
        hf_rtp.save_training_state(str(tmp_path / "state"), model, optimizer)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("spelling", ["{tmp}/state/", "{tmp}/state//", "~/state", "state", "./state/"])
def test_training_state_paths_are_normalised(ckpt, tmp_path, monkeypatch, spelling):
    model, optimizer = trained_one_step(ckpt)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = spelling.format(tmp=tmp_path)
    for _ in range(2):  # the second save replaces the first: the spelling names the same folder both times
        hf_rtp.save_training_state(path, model, optimizer, extra={"step": 3})
    assert unplanted(os.listdir(tmp_path)) == ["state"]
    assert hf_rtp.load_training_state(path, *_fresh(ckpt)) == {"step": 3}


def test_extra_cannot_overwrite_hf_rtps_records(ckpt, tmp_path):
    model, optimizer = trained_one_step(ckpt)
    extra = {
        "files": ["mine"],
        "rng": 1,
        "param_groups": None,
        "scheduler": "x",
        "identity": {},
        "world_size": 8,
        "format": 99,
        "extra": {"nested": True},
        "step": 5,
    }
    hf_rtp.save_training_state(str(tmp_path / "state"), model, optimizer, extra=extra)
    fresh, fresh_optimizer = _fresh(ckpt)
    assert hf_rtp.load_training_state(str(tmp_path / "state"), fresh, fresh_optimizer) == extra
    assert _same(_weights(fresh), _weights(model))
    with pytest.raises(hf_rtp.KeywordError, match="extra must hold only JSON values"):  # a TypeError too
        hf_rtp.save_training_state(str(tmp_path / "other"), model, optimizer, extra={"step": torch.zeros(1)})
    assert not os.path.exists(tmp_path / "other") and not os.path.exists(tmp_path / "other.partial")


def test_a_checkpoint_saved_before_extra_had_its_own_key_still_resumes(ckpt, tmp_path):
    import json

    model, optimizer = trained_one_step(ckpt)
    state = tmp_path / "state"
    hf_rtp.save_training_state(str(state), model, optimizer, extra={"step": 4})
    record = json.loads((state / "training_state.json").read_text())
    record.update(format=1, step=4)  # the format-1 layout: extra merged into the records
    del record["extra"]
    (state / "training_state.json").write_text(json.dumps(record))
    assert hf_rtp.load_training_state(str(state), *_fresh(ckpt)) == {"step": 4}


def test_a_forged_journal_that_matches_every_file_still_removes_nothing_without_its_staging_folder(
    ckpt, tmp_path, hf_rtp_warnings
):
    """A journal can be written to match the folder exactly (its files' inodes, sizes and times) and
    list the user's shards to remove; without the staging folder and marker of its save, nothing is."""
    import json
    import stat as stat_

    folder = shutil.copytree(ckpt, tmp_path / "cloned")
    (folder / "model-00001-of-00002.safetensors").write_text("the user's")

    def ident(name):
        st = os.lstat(folder / name)
        return [stat_.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns]

    save_id = "f" * 32
    (folder / ".hf_rtp-commit.json").write_text(
        json.dumps(
            {
                "format": "hf_rtp-commit/2",
                "save_id": save_id,
                "staging": ".hf_rtp-staging-" + save_id,
                "entry": "model.safetensors",
                "moves": {"model.safetensors": {"new": ident("model.safetensors"), "old": None}},
                "aside": {},
                "remove": {"model-00001-of-00002.safetensors": ident("model-00001-of-00002.safetensors")},
            }
        )
    )
    before = snapshot(tmp_path)
    hf_rtp.from_pretrained(str(folder))
    assert snapshot(tmp_path) == before
    assert "staging folder .hf_rtp-staging-ffff" in hf_rtp_warnings.text


def _save_failing_mid_commit(model, *args, **kwargs) -> None:
    """model.save_pretrained(*args, **kwargs) with the fault `raise@save.commit.mid` (the disk full mid-commit)."""
    os.environ["HF_RTP_FAULT"] = "raise@save.commit.mid"
    try:
        with pytest.raises(hf_rtp.CheckpointError, match="No space left on device"):
            model.save_pretrained(*args, **kwargs)
    finally:
        del os.environ["HF_RTP_FAULT"]
