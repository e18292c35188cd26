"""On a 2-D grid a rank that stops in backward, between its ring and the all-reduce over replicas,
is an error within the timeout on every other rank: its replica partner waits in the all-reduce,
its ring partner in the next walk, and the fourth rank behind them."""

import os
import time

from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

TIMEOUT = 10


def _train_two_steps(ckpt):
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, rtp_size=2).train()
    start = time.monotonic()
    try:
        for step in range(2):
            batch = global_batch(4, seed=step)[int(os.environ["RANK"])]
            model(input_ids=batch, labels=batch).loss.backward()
    except hf_rtp.HfRtpError as err:
        return time.monotonic() - start, f"{type(err).__name__}: {err}"
    return time.monotonic() - start, None


def test_a_rank_stopped_before_the_replicas_all_reduce_is_an_error_on_every_other_rank_in_time(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    env = {"HF_RTP_TIMEOUT": str(TIMEOUT), "HF_RTP_FAULT": "stop@replicas.reduce#3"}
    outcomes = run_on_ranks(_train_two_steps, 4, ckpt, env=env, survivors=(0, 1, 2), timeout=120)
    for rank, (seconds, message) in zip((0, 1, 2), outcomes, strict=True):
        assert message is not None, f"rank {rank} finished although rank 3 never reduced"
        assert seconds < 3 * TIMEOUT, (rank, seconds)
        assert message.startswith("CollectiveMisuseError"), (rank, message)
    # rank 1 holds the other copy of rank 3's chunk: it is the one left in the all-reduce
    assert "waited for the other replicas' gradients" in outcomes[1][1]
