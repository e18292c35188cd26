"""settings.py: a LoadSpec gives from_pretrained's own keywords for every setting a keyword sets, so a model
loaded "like" another (TRL's reference model) gets the same settings, not a hand-kept copy of some of them."""

import dataclasses
import inspect
from datetime import timedelta

import torch

import hf_rtp
from hf_rtp.settings import LoadSpec, Settings


def test_every_setting_but_the_environments_comes_from_a_from_pretrained_keyword():
    keywords = set(inspect.signature(hf_rtp.from_pretrained).parameters)
    from_keywords = {f.name: f.metadata.get("keyword") for f in dataclasses.fields(Settings)}
    assert {n for n, k in from_keywords.items() if k is None} == {"entry_timeout"}  # HF_RTP_ENTRY_TIMEOUT only
    assert {k for k in from_keywords.values() if k} <= keywords


def test_a_load_spec_reproduces_the_settings_and_carries_the_grid_and_plan():
    settings = Settings.resolve(
        device="cpu",
        timeout=123,
        rotation_piece_size="3MB",
        verify_weights="full",
        fused_loss=False,
        reduce_dtype=torch.bfloat16,
        rotation_moves="weights",
    )
    spec = settings.load_spec(device_mesh=None, rtp_size=2, plan="auto")
    assert isinstance(spec, LoadSpec)
    given = spec.keywords()
    assert {k: given.pop(k) for k in ("device_mesh", "rtp_size", "plan")} == {
        "device_mesh": None,
        "rtp_size": 2,
        "plan": "auto",
    }
    assert given["timeout"] == timedelta(seconds=123) and given["rotation_piece_size"] == 3_000_000
    again = Settings.resolve(**given)
    assert dataclasses.replace(again, entry_timeout=settings.entry_timeout) == settings
    assert set(given) | {"device_mesh", "rtp_size", "plan"} <= set(inspect.signature(hf_rtp.from_pretrained).parameters)
