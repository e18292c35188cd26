"""The whole fault suite runs beside hostile folders: every test's tmp_path (the folder its checkpoints
and training states live in) carries an old journal, a journal in hf_rtp's format whose staging
folder is a link to a victim folder elsewhere (with a forged marker), a staging-named folder of the
user's own, and a user file. Whatever a test kills, stops or damages, none of these may be deleted,
moved or changed, and the victim folder must stay byte-identical: checked after every test."""

import pytest
from support.folders import PLANTED, make_victim, plant_hostile, snapshot


@pytest.fixture(autouse=True)
def hostile_folder(tmp_path, tmp_path_factory):
    victim = make_victim(tmp_path_factory.mktemp("victim"))
    plant_hostile(tmp_path, victim)
    planted, victim_before = _planted(tmp_path), snapshot(victim)
    yield
    assert _planted(tmp_path) == planted, "hf_rtp touched a planted file, link or journal"
    assert snapshot(victim) == victim_before, "hf_rtp touched a folder outside the checkpoint"


def _planted(folder):
    return {k: v for k, v in snapshot(folder).items() if k.split("/")[0] in PLANTED}
