"""A rank that fails inside resize_token_embeddings (out of memory holding the old and new matrices, here
an OSError raised at the named point "resize.draw") is an hf_rtp error on every rank, naming that rank, at
once: not gloo's words after HF_RTP_TIMEOUT on the ranks that went on to wait for it."""

import time

import pytest
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks


def _resize(ckpt):
    import torch

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    start = time.monotonic()
    try:
        model.resize_token_embeddings(VOCAB + 6)
    except hf_rtp.RotatedStateError as err:
        return time.monotonic() - start, str(err)
    return None


@pytest.mark.parametrize("failing", [0, 1])  # the writer, and a rank that only receives
def test_a_rank_failing_inside_a_resize_is_every_ranks_error_naming_it(tmp_path, failing):
    env = {"HF_RTP_TIMEOUT": "60", "HF_RTP_FAULT": f"raise@resize.draw#{failing}"}
    for rank, outcome in enumerate(run_on_ranks(_resize, 2, make_tiny("llama", tmp_path / "ckpt"), env=env)):
        assert outcome is not None, rank
        seconds, message = outcome
        assert f"rank {failing} failed" in message and "OSError" in message, (rank, message)
        assert seconds < 30, (rank, seconds)  # agreed at once, far inside HF_RTP_TIMEOUT
