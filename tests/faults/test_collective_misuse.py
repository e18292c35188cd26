"""Calls every rank must make fail fast, on every rank that made them, when some rank does not.

Each case injects the fault at a named point of the test body: which rank skips (or swaps) which
call. HF_RTP_ENTRY_TIMEOUT is 5 s here (60 s by default) so the suite stays quick; the bound is
asserted, so a hang or a late failure fails the test.
"""

import os
import time

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

from hf_rtp.private.torch_names import SUBCLASS_DISPATCH_BYPASSED

ENTRY = {"HF_RTP_ENTRY_TIMEOUT": "5"}


def _only_rank0_calls(ckpt, call, out):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    import hf_rtp

    rank = int(os.environ["RANK"])
    # the script's own world group, with a long timeout: rank 1's barrier below outwaits rank 0's failure
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    batch = global_batch(2)[rank]
    outcome = None
    if rank == 0:  # the fault: rank 1 never makes the call (`if accelerator.is_main_process:`)
        start = time.monotonic()
        try:
            if call == "save_pretrained":
                model.save_pretrained(out)
            elif call == "push_to_hub":
                model.push_to_hub("user/repo")
            elif call == "generate":
                model.generate(batch, max_new_tokens=2)
            elif call == "sync_grads":  # a plain loop's average of the norms' gradients, on one rank only
                hf_rtp.sync_grads(model)
            elif call == "full_tensor":  # e.g. logging a weight from the main process only
                model.lm_head.weight.full_tensor()
            elif call == "redistribute":
                with torch.no_grad():
                    model.lm_head.weight.redistribute(placements=[Replicate()])
            elif call == "w @ w.T":  # a DTensor op that communicates inside dispatch (it gathers w.T)
                with torch.no_grad():
                    weight = model.lm_head.weight
                    weight @ weight.T
            else:
                model(input_ids=batch)
        except hf_rtp.CollectiveMisuseError as err:
            outcome = (time.monotonic() - start, str(err))
    dist.barrier()  # rank 1 waits here for rank 0, as it would at the next step of a script
    return outcome


@pytest.mark.parametrize("call", ["save_pretrained", "push_to_hub", "generate", "forward", "sync_grads"])
def test_a_call_made_by_one_rank_fails_there_within_the_entry_timeout(tmp_path, call):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (seconds, message), skipped = run_on_ranks(_only_rank0_calls, 2, ckpt, call, str(tmp_path / "out"), env=ENTRY)
    assert skipped is None
    assert 4 <= seconds < 30, seconds
    assert f"{call} is collective: every rank must call it" in message and "HF_RTP_ENTRY_TIMEOUT" in message
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


@pytest.mark.parametrize(
    "call, env, expected",
    [
        ("full_tensor", ENTRY, "full_tensor is collective: every rank of the ring must call it"),
        ("redistribute", ENTRY, "redistribute is collective: every rank of the ring must call it"),
        # no entry to meet at: the op's own collective times out (HF_RTP_TIMEOUT), and is named
        (
            "w @ w.T",
            {"HF_RTP_TIMEOUT": "5"},
            "aten.mm.default on a rotated tensor is collective: every rank of its ring must run it",
        ),
    ],
)
def test_a_collective_on_a_rotated_tensor_made_by_one_rank_is_named(tmp_path, call, env, expected):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (seconds, message), skipped = run_on_ranks(_only_rank0_calls, 2, ckpt, call, str(tmp_path / "out"), env=env)
    assert skipped is None
    assert 4 <= seconds < 30, seconds
    if SUBCLASS_DISPATCH_BYPASSED:  # torch 2.11: the op as Python called it, one level above aten's
        expected = expected.replace("aten.mm.default", "torch.Tensor.matmul")
    assert expected in message, message


def _different_calls(ckpt, first):
    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    batch = global_batch(2)[rank]
    start = time.monotonic()
    with pytest.raises(hf_rtp.CollectiveMisuseError) as caught:
        if rank == 0 and first == "generate":  # the fault: rank 0 samples while rank 1 runs an eval forward
            model.generate(batch, max_new_tokens=2)
        elif rank == 0:  # the fault: rank 1 skipped sync_grads and went on to its next step's forward
            hf_rtp.sync_grads(model)
        else:
            model(input_ids=batch)
    return time.monotonic() - start, str(caught.value)


@pytest.mark.parametrize("first", ["generate", "sync_grads"])
def test_ranks_in_different_calls_both_fail_at_once_naming_the_calls(tmp_path, first):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for seconds, message in run_on_ranks(_different_calls, 2, ckpt, first, env=ENTRY):
        assert seconds < 4, seconds  # no waiting for the timeout: the calls are compared at entry
        assert f"rank 0: {first}, rank 1: forward" in message


def _stall_in_backward(ckpt):
    import torch.distributed as dist

    import hf_rtp

    rank = int(os.environ["RANK"])
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    # accelerate makes the world group, with the user's own (long) timeout, which hf_rtp respects
    accelerator = hf_rtp.Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=30))])
    assert dist.is_initialized()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    batch = global_batch(2)[rank]
    loss = model(input_ids=batch, labels=batch).loss
    outcome = None
    if rank == 0:  # the fault: rank 1 stops before backward
        start = time.monotonic()
        try:
            loss.backward()
        except hf_rtp.CollectiveMisuseError as err:
            outcome = (time.monotonic() - start, str(err))
    dist.barrier()
    del accelerator
    return outcome


def test_hf_rtp_timeout_holds_when_accelerate_made_the_process_group(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    (seconds, message), _ = run_on_ranks(_stall_in_backward, 2, ckpt, env={"HF_RTP_TIMEOUT": "5"})
    assert 4 <= seconds < 40, seconds
    assert "ring neighbour (global rank 1) past hf_rtp's timeout (HF_RTP_TIMEOUT)" in message, message


@pytest.mark.parametrize(
    "variable, value",
    [
        ("HF_RTP_TIMEOUT", "10 minutes"),
        ("HF_RTP_ENTRY_TIMEOUT", "-1"),
        ("HF_RTP_TIMEOUT", "1e14"),
        ("HF_RTP_TIMEOUT", "100000000000000"),
        ("HF_RTP_ENTRY_TIMEOUT", "1e20"),
        ("HF_RTP_TIMEOUT", "0.001"),
        ("HF_RTP_ENTRY_TIMEOUT", "8d"),
    ],
)
def test_a_bad_timeout_setting_is_a_clear_error(tmp_path, monkeypatch, variable, value):
    import hf_rtp

    monkeypatch.setenv(variable, value)
    with pytest.raises(
        hf_rtp.TopologyError, match=f"{variable} .*from 1 second to 7 days: seconds like 600, or 90s.*'{value}'"
    ):
        hf_rtp.from_pretrained(str(tmp_path / "checked-before-it-is-read"))


@pytest.mark.parametrize("value", [1e14, 0.001, float("nan"), float("inf")])
def test_a_timeout_argument_out_of_range_is_a_clear_error(tmp_path, value):
    import hf_rtp

    with pytest.raises(hf_rtp.TopologyError, match=r"HF_RTP_TIMEOUT \(or timeout=\) must be a duration from 1 second"):
        hf_rtp.from_pretrained(str(tmp_path / "checked-before-it-is-read"), timeout=value)


@pytest.mark.parametrize(
    "value, seconds", [("600", 600), ("90s", 90), ("10m", 600), ("1.5h", 5400), (" 2M ", 120), ("1", 1), ("7d", 604800)]
)
def test_timeouts_take_seconds_or_a_unit(monkeypatch, value, seconds):
    from hf_rtp.settings import DEFAULT_TIMEOUT, as_timedelta

    monkeypatch.setenv("HF_RTP_TIMEOUT", value)
    assert as_timedelta(None, "HF_RTP_TIMEOUT", DEFAULT_TIMEOUT).total_seconds() == seconds


def test_the_entry_timeout_defaults_to_a_minute(monkeypatch):
    from hf_rtp.settings import DEFAULT_ENTRY_TIMEOUT, as_timedelta

    monkeypatch.delenv("HF_RTP_ENTRY_TIMEOUT", raising=False)
    assert as_timedelta(None, "HF_RTP_ENTRY_TIMEOUT", DEFAULT_ENTRY_TIMEOUT).total_seconds() == 60


def _plain_accelerator(ckpt, built_first):
    from accelerate import Accelerator

    import hf_rtp

    pattern = r"accelerate runs 1 process\(es\) but the rotated model spans 2 ranks.*cpu=True"
    if built_first:  # no cpu=True on a machine without CUDA: accelerate runs undistributed
        accelerator = Accelerator()
        with pytest.raises(hf_rtp.TopologyError, match=pattern):
            hf_rtp.from_pretrained(ckpt)
    else:  # built after loading, it still comes up undistributed: the first forward says so
        model = hf_rtp.from_pretrained(ckpt)
        accelerator = Accelerator()
        model = accelerator.prepare(model)
        with pytest.raises(hf_rtp.TopologyError, match=pattern):
            model(input_ids=global_batch(2)[0])
    return accelerator.num_processes


@pytest.mark.parametrize("built_first", [True, False], ids=["before-loading", "after-loading"])
def test_an_accelerator_that_runs_undistributed_is_refused(tmp_path, built_first):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_plain_accelerator, 2, ckpt, built_first) == [1, 1]


def _trainer_without_use_cpu(ckpt):
    from transformers import Trainer, TrainingArguments

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt)
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(ckpt), "out"), report_to=[])  # no use_cpu=True
    with pytest.raises(hf_rtp.TopologyError, match=r"Trainer runs 1 process\(es\).*use_cpu=True") as refused:
        Trainer(model=model, args=args)  # fails at construction, before any step trains the wrong thing
    # the arguments parsed first, as the example scripts do: the load fails, in a Trainer user's words
    with pytest.raises(hf_rtp.TopologyError, match=r"TrainingArguments' .* 1 process\(es\).*use_cpu=True") as early:
        hf_rtp.from_pretrained(ckpt)
    assert "Accelerator(cpu=True)" not in str(refused.value) + str(early.value)  # which a Trainer user cannot pass
    return args.world_size


def test_a_trainer_that_runs_undistributed_is_refused_at_construction(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_trainer_without_use_cpu, 2, ckpt) == [1, 1]


def _main_process_waits_alone(flag):
    import hf_rtp

    rank = int(os.environ["RANK"])
    accelerator = hf_rtp.Accelerator()  # accelerate creates the world group here
    if rank == 1:  # the fault: rank 1 skips wait_for_everyone and idles until rank 0 has given up
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        accelerator.wait_for_everyone()
        outcome = None
    except RuntimeError:
        outcome = time.monotonic() - start
    open(flag, "w").close()
    return outcome


def test_hf_rtp_accelerator_gives_accelerates_world_group_hf_rtps_timeout(tmp_path):
    seconds, _ = run_on_ranks(_main_process_waits_alone, 2, str(tmp_path / "flag"), env={"HF_RTP_TIMEOUT": "4"})
    assert seconds is not None and 3 <= seconds < 30, seconds  # accelerate's default would be 30 minutes


def _generate_differently(ckpt, settings):
    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    batch = global_batch(2, seq=4 + rank)[rank]  # each rank its own prompts: that is not a difference
    start = time.monotonic()
    with pytest.raises(hf_rtp.CollectiveMisuseError) as caught:
        model.generate(batch, pad_token_id=0, **settings[rank])
    return time.monotonic() - start, str(caught.value)


@pytest.mark.parametrize(
    "settings, named",
    [
        (
            [dict(max_new_tokens=3), dict(max_new_tokens=5)],
            ["max_new_tokens (rank 0: 3, rank 1: 5)"],
        ),
        (
            [dict(max_new_tokens=3, do_sample=True, temperature=0.7), dict(max_new_tokens=3, do_sample=False)],
            ["do_sample (rank 0: True, rank 1: False)", "temperature (rank 0: 0.7, rank 1: None)"],
        ),
    ],
)
def test_ranks_that_generate_with_different_settings_fail_at_once_naming_them(tmp_path, settings, named):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for seconds, message in run_on_ranks(_generate_differently, 2, ckpt, settings, env=ENTRY, attempts=1):
        assert seconds < 4, seconds  # compared as the ranks enter, before any forward
        assert "ranks called generate with different settings" in message, message
        assert all(n in message for n in named), message


def _stopped_mid_generation(ckpt):
    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    batch = global_batch(2)[rank]
    start = time.monotonic()
    with pytest.raises(hf_rtp.CollectiveMisuseError) as caught:
        model.generate(batch, max_new_tokens=6, pad_token_id=0)  # rank 1 stops at its third forward (HF_RTP_FAULT)
    return time.monotonic() - start, str(caught.value)


@pytest.mark.parametrize("action, named", [("stop", "rank 1 is stopped or gone"), ("kill", "rank 1's process exited")])
def test_a_rank_that_stops_mid_generation_ends_the_others_naming_it(tmp_path, action, named):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    env = {**ENTRY, "HF_RTP_FAULT": f"{action}@forward#1:3"}
    ((seconds, message),) = run_on_ranks(_stopped_mid_generation, 2, ckpt, env=env, survivors=(0,), attempts=1)
    assert seconds < 30, seconds
    assert named in message, message


def _killed_mid_walk(ckpt):
    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, timeout=10).train()
    batch = global_batch(2)[rank]
    model(input_ids=batch, labels=batch).loss.backward()  # rank 1 dies at its 40th hop, in the second step
    start = time.monotonic()
    with pytest.raises(hf_rtp.CollectiveMisuseError) as caught:
        for _ in range(2):
            model(input_ids=batch, labels=batch).loss.backward()
    return time.monotonic() - start, str(caught.value)


def test_a_rank_killed_mid_walk_ends_its_neighbour_naming_it(tmp_path):
    """Killed between two hops of a walk (HF_RTP_FAULT at "ring.hop"), where its neighbour has a hop in flight to
    it: the neighbour's wait fails with hf_rtp's error naming the dead rank, at once over gloo (its connection
    closes). tests/gpu/test_nccl_ring_cuda.py kills a rank the same way over NCCL, where nothing closes."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    env = {**ENTRY, "HF_RTP_FAULT": "kill@ring.hop#1:40"}
    ((seconds, message),) = run_on_ranks(_killed_mid_walk, 2, ckpt, env=env, survivors=(0,), attempts=1)
    assert seconds < 10, seconds
    assert "ring neighbour (global rank 1)" in message and "lost a rank" in message, message
