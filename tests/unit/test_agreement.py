"""hf_rtp/distributed/ranks/agreement.py: a failure on one rank is the same error on every rank, naming the rank that
failed, never a hang in the next collective. In one process (no group) the error is still the class a rank would
raise; at two real gloo ranks every rank raises the failing rank's class (or the caller's `wrap`) and the group
stays usable afterwards."""

from __future__ import annotations

import pytest
from support.spawn import run_on_ranks

from hf_rtp.distributed.ranks.agreement import Attempts, agreed, raise_if_any_failed
from hf_rtp.errors import CheckpointError, HfRtpError, PlanError, SettingError, TopologyError

# --- one process, torch.distributed not initialised


def test_without_a_group_a_foreign_error_becomes_the_wrap_class_chained_to_the_original():
    with pytest.raises(CheckpointError, match=r"^ValueError: bad shard$") as caught, agreed(None, CheckpointError):
        raise ValueError("bad shard")
    assert isinstance(caught.value.__cause__, ValueError)


def test_without_a_group_an_hf_rtp_error_is_raised_as_it_is():
    error = SettingError("HF_RTP_TIMEOUT is not a number")
    with pytest.raises(SettingError) as caught, agreed(None, CheckpointError):  # not turned into the wrap
        raise error
    assert caught.value is error


def test_a_block_that_succeeds_raises_nothing_and_keyboard_interrupt_is_not_agreed_on():
    with agreed(None):
        pass
    raise_if_any_failed(None)
    with pytest.raises(KeyboardInterrupt), agreed(None, CheckpointError):  # ends the process, never wrapped
        raise KeyboardInterrupt


def test_attempts_keep_the_first_failure_and_skip_later_steps_with_arguments_bound_at_the_call():
    ran, attempts = [], Attempts()

    def step(i):
        ran.append(i)
        if i == 1:
            raise OSError(28, "No space left on device")
        return i * 10

    results = [attempts.attempt(step, i) for i in range(4)]
    assert results == [0, None, None, None]
    assert ran == [0, 1]  # steps 2 and 3 were skipped, each with its own i
    assert isinstance(attempts.error, OSError)
    with pytest.raises(CheckpointError, match="No space left on device"), agreed(None, CheckpointError):
        attempts.raise_first()
    Attempts().raise_first()  # nothing failed: nothing raised


# --- two real ranks over gloo


def _outcome(block) -> tuple:
    try:
        block()
    except Exception as err:
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else None
        return type(err).__name__, str(err), cause
    return None


def _scenarios():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def failing_on(ranks, error, wrap=HfRtpError):
        def block():
            with agreed(None, wrap):
                if rank in ranks:
                    raise error

        return block

    out = {
        "hf_rtp error on rank 1": _outcome(failing_on({1}, CheckpointError("shard 3 unreadable"), CheckpointError)),
        "foreign error on rank 0": _outcome(failing_on({0}, OSError("disk full"), TopologyError)),
        "own class beats the wrap": _outcome(failing_on({1}, SettingError("bad timeout"), CheckpointError)),
        "both fail": _outcome(failing_on({0, 1}, ValueError("mine") if rank == 0 else PlanError("theirs"))),
        "nobody fails": _outcome(failing_on(set(), ValueError("never raised"))),
    }
    # a writer's file steps between transfers: the failing rank keeps taking part in every all_reduce
    attempts, steps_run, sums = Attempts(), [], []

    def step(i):
        steps_run.append(i)
        if rank == 1 and i == 1:
            raise OSError(5, "Input/output error")

    def interleaved():
        for i in range(3):
            attempts.attempt(step, i)
            one = torch.ones(1)
            dist.all_reduce(one)
            sums.append(one.item())
        with agreed(None, CheckpointError):
            attempts.raise_first()

    out["attempts"] = _outcome(interleaved)
    out["steps run"], out["transfers"] = steps_run, sums
    dist.barrier()  # after every agreement the group still works: no rank left behind in a collective
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_scenarios, 2)


def test_an_hf_rtp_error_on_one_rank_is_that_class_on_every_rank_naming_it(two_ranks):
    rank0, rank1 = (r["hf_rtp error on rank 1"] for r in two_ranks)
    assert rank0[:2] == ("CheckpointError", "rank 1 failed: shard 3 unreadable")
    assert rank1[:2] == ("CheckpointError", "shard 3 unreadable")  # the failing rank raises its own error


def test_a_foreign_error_is_the_wrap_class_on_every_rank_and_the_failing_rank_chains_it(two_ranks):
    rank0, rank1 = (r["foreign error on rank 0"] for r in two_ranks)
    assert rank0 == ("TopologyError", "rank 0 failed: OSError: disk full", "OSError")
    assert rank1 == ("TopologyError", "rank 0 failed: OSError: disk full", None)


def test_the_failing_ranks_own_hf_rtp_class_is_raised_everywhere_not_the_wrap(two_ranks):
    rank0, rank1 = (r["own class beats the wrap"] for r in two_ranks)
    assert rank0[:2] == ("SettingError", "rank 1 failed: bad timeout")
    assert rank1[:2] == ("SettingError", "bad timeout")


def test_when_several_ranks_fail_each_hf_rtp_error_stays_and_others_name_the_first(two_ranks):
    rank0, rank1 = (r["both fail"] for r in two_ranks)
    assert rank0 == ("HfRtpError", "rank 0 failed: ValueError: mine", "ValueError")
    assert rank1[:2] == ("PlanError", "theirs")
    assert all(r["nobody fails"] is None for r in two_ranks)


def test_attempts_skip_a_failed_ranks_later_steps_but_never_its_transfers(two_ranks):
    rank0, rank1 = two_ranks
    assert rank0["steps run"] == [0, 1, 2] and rank1["steps run"] == [0, 1]
    assert rank0["transfers"] == rank1["transfers"] == [2.0, 2.0, 2.0]  # both ranks in all three all_reduces
    assert rank0["attempts"][:2] == ("CheckpointError", "rank 1 failed: OSError: [Errno 5] Input/output error")
    assert rank1["attempts"] == (*rank0["attempts"][:2], "OSError")
