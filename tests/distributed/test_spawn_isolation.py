"""Ranks start as forks of a fork server that preloaded transformers and hf_rtp (support/spawn.py): a test
on them must be as independent as one whose ranks import everything afresh. What one test's ranks leave
behind (a process group, RNG state, DTensor's flag, environment, open files, module state) is not seen
by the next; and a test that changes what the preloaded libraries read at import is stopped, not run
on the fork server's stale reading."""

import os

import pytest
from support.spawn import run_on_ranks


def _leave_state_behind(path):
    import torch
    import torch.distributed as dist
    import transformers

    from hf_rtp.private.torch_names import set_implicit_replication

    dist.init_process_group("gloo")
    torch.manual_seed(1234)
    set_implicit_replication(True)
    os.environ["HF_RTP_LEFT_BEHIND"] = "1"
    transformers.LEFT_BEHIND = True
    open(path, "w").write("held")  # noqa: SIM115 (left open on purpose)
    return _observe()


def _observe():
    import torch
    import torch.distributed as dist
    import transformers

    from hf_rtp.private.torch_names import implicit_replication

    return {
        "group": dist.is_initialized(),
        "rng": torch.random.get_rng_state().sum().item(),
        "implicit_replication": implicit_replication(),
        "env": os.environ.get("HF_RTP_LEFT_BEHIND"),
        "module": getattr(transformers, "LEFT_BEHIND", None),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def test_what_one_test_leaves_behind_does_not_reach_the_next(tmp_path):
    before = run_on_ranks(_observe, 2)
    dirty = run_on_ranks(_leave_state_behind, 2, str(tmp_path / "open"))
    assert all(d["group"] and d["implicit_replication"] and d["env"] == "1" and d["module"] for d in dirty)
    assert [d["rng"] for d in dirty] != [b["rng"] for b in before]  # the observer would see a leak
    after = run_on_ranks(_observe, 2)
    assert after == before
    assert not before[0]["group"] and before[0]["implicit_replication"] is False and before[0]["env"] is None


def test_a_test_that_changes_what_transformers_read_at_import_is_stopped(tmp_path):
    with pytest.raises(RuntimeError, match=r"HF_HUB_CACHE.*read at import.*fresh=True"):
        run_on_ranks(_observe, 2, env={"HF_HUB_CACHE": str(tmp_path / "cache")})
    fresh = run_on_ranks(_cache_seen, 1, env={"HF_HUB_CACHE": str(tmp_path / "cache")}, fresh=True)
    assert fresh == [str(tmp_path / "cache")]  # a fresh interpreter reads it as the test set it


def _cache_seen():
    import huggingface_hub.constants

    return huggingface_hub.constants.HF_HUB_CACHE


def _crash_on_rank_1():
    import ctypes

    if os.environ["RANK"] == "1":
        ctypes.string_at(0)  # a segfault in C, as a CUDA library's can be: no traceback, nothing on the queue
    return "rank 0's result"


@pytest.mark.parametrize("fresh", [False, True])
def test_a_rank_that_dies_in_c_fails_the_test_at_once_with_its_signal(fresh):
    # before, the test waited out the whole timeout and said only "gave no result" (.ci/gpu's QLoRA stage, twice)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited without a result \(exit codes \{1: -11\}\)"):
        run_on_ranks(_crash_on_rank_1, 2, timeout=600, fresh=fresh)
