"""`hf-rtp bench` runs every strategy for real in one invocation and writes its table, JSON and chart."""

import json
import os
import subprocess
import sys

import pytest

STRATEGIES = ["single", "ddp", "fsdp2", "tp", "rtp"]


def test_bench_runs_every_strategy_side_by_side(tmp_path):
    out = tmp_path / "out"
    # 2 ranks only: 4 processes per strategy on CI's 2 cores cost a minute; notebooks/03_memory runs 4
    cmd = [
        sys.executable,
        "-m",
        "hf_rtp",
        "bench",
        "--preset",
        "llama-tiny",
        "--world-sizes",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--rtp-size",
        "1",
        "--output",
        str(out),
    ]
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the preset checkpoint is made under TMPDIR
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((out / "results.json").read_text())
    assert result["failed"] == []
    rows = {(r["strategy"], r["world_size"]): r for r in result["results"]}
    # --rtp-size 1 adds RTP as rings of one beside the flat ring: 2 replicas, nothing rotated
    assert set(rows) == {("single", 1), ("rtp-2d", 2)} | {(s, 2) for s in STRATEGIES[1:]}
    single = rows[("single", 1)]
    for (strategy, n), r in rows.items():
        assert r["peak_gb"] > 0 and r["step_s"] > 0 and r["load_s"] > 0, (strategy, n)
        assert len(r["ranks"]) == n
        # rank 0 trains on the same first batch in every strategy (TP on all ranks): same model, same loss
        assert abs(r["loss_first"] - single["loss_first"]) < 1e-4, (strategy, n)
        batches = 1 if strategy == "tp" else n
        assert abs(r["tokens_per_s"] - batches * 2 * 128 / r["step_s"]) < 1e-6 * r["tokens_per_s"]
        assert r["ideal_gb"] == r["ideal_gb"] and r["efficiency"] > 0  # from the single-process run
        assert r["estimate_gb"] > 0
    # what each rank holds: RTP about 1/N of the parameters, DDP all of them
    assert rows[("ddp", 2)]["local_param_gb"] == single["local_param_gb"]
    assert rows[("rtp", 2)]["local_param_gb"] < single["local_param_gb"] / 2 * 1.05
    assert rows[("rtp-2d", 2)]["local_param_gb"] == single["local_param_gb"] and rows[("rtp-2d", 2)]["rtp_size"] == 1
    assert "N=2: rings of 1 (2 replicas) / one flat ring: memory" in done.stdout
    for s in STRATEGIES:
        assert s in done.stdout
    assert "rtp/ddp: memory" in done.stdout and "rtp/fsdp2" in done.stdout
    # hops per step: a rotated model's walks post them, no other strategy has a ring
    assert rows[("rtp", 2)]["exchanges_per_step"] > 0 and rows[("ddp", 2)]["exchanges_per_step"] == 0
    assert "exchanges (hops)" in done.stdout

    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(out / "bench.png")).shape
    assert width > 2 * height  # three panels side by side: memory, tokens/s, memory against world size


def test_bench_refuses_bad_arguments(tmp_path):
    # in process, through the `hf-rtp` entry point: the refusals come before anything is spawned
    from hf_rtp.tools.cli import main

    bad = [
        ["--strategies", "ddp,zero3"],
        ["--world-sizes", "0"],
        ["--world-sizes", "two"],
        ["--warmup", "0", "--steps", "1"],  # a peak before the second step would miss AdamW's moments
        ["--strategies", "rtp-2d"],  # rings of how many?
        ["--world-sizes", "4", "--rtp-size", "3"],
        ["--world-sizes", "2", "--rtp-size", "2"],  # one ring of 2 is the flat ring
        ["--fsdp2-prefetch", "-1"],
        ["--strategies", "ddp", "--profile", str(tmp_path / "profile")],  # profiles rtp, which does not run
    ]
    for args in bad:
        with pytest.raises(SystemExit) as refused:
            main(["bench", "--output", str(tmp_path / "never"), *args])
        assert isinstance(refused.value.code, str) and refused.value.code, args  # a message, not a bare exit code
    assert not (tmp_path / "never").exists()


@pytest.fixture(scope="module")
def rank_server():
    """One rank server for the in-process runs below, as a script that benches several times can keep one:
    each bench.main forks its ranks from it instead of starting its own."""
    from hf_rtp.tools.bench.processes import preloaded_ranks

    with preloaded_ranks(threads=1) as server:
        yield server


def _bench(tmp_path, capsys, args: list[str]) -> str:
    """hf_rtp.tools.bench.main in this process, as notebooks/03 calls it (the command line has its own test
    above): the same runs and files, without a second interpreter importing everything; what it printed.
    Callers take the `rank_server` fixture."""
    from hf_rtp.tools.bench import main
    from hf_rtp.tools.bench.presets import make_preset

    capsys.readouterr()
    main(["--checkpoint", make_preset("llama-tiny", str(tmp_path / "llama-tiny")), *args])
    return capsys.readouterr().out


def test_budget_mode_reports_each_strategys_largest_batch_that_was_seen_to_fit(tmp_path, capsys, rank_server):
    out = tmp_path / "out"
    budget = 0.1  # GB per rank: the tiny preset's estimates put DDP at 4 sequences of 128, RTP at 8
    args = [
        "--world-sizes",
        "2",
        "--strategies",
        "ddp,rtp",
        "--budget-gb",
        str(budget),
        "--warmup",
        "1",
        "--steps",
        "1",
        "--output",
        str(out),
    ]
    printed = _bench(tmp_path, capsys, args)
    rows = {r["strategy"]: r for r in json.loads((out / "budget.json").read_text())["budget"]}
    for strategy, r in rows.items():
        assert r["batch"] >= 1 and 0 < r["peak_gb"] <= budget, (strategy, r["batch"], r["peak_gb"])
        assert abs(r["tokens_per_s"] - 2 * r["batch"] * 128 / r["step_s"]) < 1e-6 * r["tokens_per_s"]
    assert rows["rtp"]["batch"] > rows["ddp"]["batch"]  # 1/N of the model states leaves room for more tokens
    assert f"within {budget} GB per rank" in printed
    assert (out / "budget.png").stat().st_size > 0


def test_autocast_trains_fsdp2_with_its_mixed_precision_policy_and_rtp_in_bf16(tmp_path, capsys, rank_server):
    # 16 tokens: this CPU has no bf16 matmul instructions (a bf16 matmul runs ~50x slower than float32)
    out = tmp_path / "out"
    args = [
        "--world-sizes",
        "2",
        "--strategies",
        "fsdp2,rtp",
        "--batch",
        "1",
        "--seq",
        "16",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--autocast",
        "--output",
        str(out),
    ]
    printed = _bench(tmp_path, capsys, args)
    result = json.loads((out / "results.json").read_text())
    assert result["settings"]["autocast"] and "bf16 autocast" in printed
    rows = {r["strategy"]: r for r in result["results"]}
    assert set(rows) == {"fsdp2", "rtp"}
    # both train on rank 0's first batch from the same weights under the same autocast: the same loss
    assert abs(rows["fsdp2"]["loss_first"] - rows["rtp"]["loss_first"]) < 1e-2


def test_fsdp2_shards_each_layer_and_its_explicit_prefetch_changes_no_number(tmp_path, capsys, rank_server):
    """--fsdp2-prefetch N: FSDP2's explicit prefetching instead of its implicit one; only when all-gathers are issued
    changes. And what every results.json records: what the run ran on, and the model's shape."""
    import torch

    results = {}
    for ahead in ("0", "1"):
        out = tmp_path / f"out-{ahead}"
        args = ["--world-sizes", "2", "--strategies", "fsdp2", "--batch", "1", "--seq", "16", "--warmup", "1"]
        args += ["--steps", "1", "--gradient-checkpointing", "--fsdp2-prefetch", ahead, "--output", str(out)]
        _bench(tmp_path, capsys, args)
        results[ahead] = json.loads((out / "results.json").read_text())
    [implicit], [explicit] = results["0"]["results"], results["1"]["results"]
    assert implicit["fsdp2"]["units"] == explicit["fsdp2"]["units"] == 3  # the tiny preset's 2 layers, the root
    assert implicit["fsdp2"]["prefetch"] == "implicit" and explicit["fsdp2"]["prefetch"] == "explicit, 1 layer(s) ahead"
    for rank in (0, 1):  # both steps, the second after an optimizer step
        assert explicit["ranks"][rank]["losses"] == pytest.approx(implicit["ranks"][rank]["losses"], rel=1e-6)
    env, model = results["1"]["environment"], results["1"]["model"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["backend"] == "gloo"
    assert (model["num_hidden_layers"], model["hidden_size"], model["tokens_per_rank"]) == (2, 128, 16)
    assert model["parameters"] == 1_450_624 and model["gradient_checkpointing"] is True


def test_generate_mode_times_greedy_decoding_per_batch_size(tmp_path, capsys, rank_server):
    out = tmp_path / "out"
    args = [
        "--world-sizes",
        "2",
        "--generate",
        "1,3",
        "--new-tokens",
        "4",
        "--seq",
        "8",
        "--output",
        str(out),
    ]
    printed = _bench(tmp_path, capsys, args)
    rows = json.loads((out / "generate.json").read_text())["decode"]
    expected = [(s, b) for s in ("ddp", "rtp", "rtp-weights", "rtp-whole", "tp") for b in (1, 3)]
    assert sorted((r["strategy"], r["batch"]) for r in rows) == expected
    assert all(r["gather_s"] > 0 for r in rows if r["strategy"] == "rtp-whole")
    for r in rows:
        sequences = r["batch"] * (1 if r["strategy"] == "tp" else 2)  # TP decodes one batch on both ranks
        assert abs(r["tokens_per_s"] - sequences * 4 / r["seconds"]) < 1e-6 * r["tokens_per_s"]
        assert r["peak_gb"] > 0
    assert "N=2 batch 3: rtp/ddp: tokens/s" in printed and (out / "generate.png").stat().st_size > 0
    assert "N=2 batch 3: rtp/rtp-weights: tokens/s" in printed


def test_grpo_mode_times_grpotrainer_steps_beside_ddp(tmp_path, capsys, rank_server):
    """--grpo: TRL's GRPOTrainer on each rank, vanilla under DDP and hf_rtp's, generation in-process."""
    out = tmp_path / "out"
    args = ["--world-sizes", "2", "--grpo", "--seq", "8", "--new-tokens", "4", "--num-generations", "2"]
    printed = _bench(tmp_path, capsys, [*args, "--steps", "3", "--output", str(out)])
    rows = {r["strategy"]: r for r in json.loads((out / "grpo.json").read_text())["grpo"]}
    assert set(rows) == {"ddp", "rtp"}
    for row in rows.values():
        assert len(row["step_times"]) == 2  # the first step (warm-up) is left out
        assert row["step_s"] == sum(row["step_times"]) / 2  # the median of two
        assert all(t > 0 for t in row["step_times"]) and len(row["rewards"]) == 2  # both ranks' logged rewards
    assert "N=2: rtp/ddp step time" in printed


def test_long_sequence_mode_cuts_one_sequence_across_the_ring(tmp_path, capsys, rank_server):
    """--long-sequence: each rank its own sequence for RTP, one across the ring for rtp-cp, and rtp-cp again on
    N x --seq tokens (RTP's tokens per step). Rank 0's sequence is the same in both: so is its first loss."""
    out = tmp_path / "out"
    args = ["--world-sizes", "2", "--long-sequence", "--seq", "256", "--strategies", "rtp,rtp-cp"]
    printed = _bench(tmp_path, capsys, [*args, "--warmup", "1", "--steps", "1", "--output", str(out)])
    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(rows) == {"rtp", "rtp-cp", "rtp-cp-same-tokens"}
    assert (rows["rtp"]["seq"], rows["rtp-cp"]["seq"], rows["rtp-cp-same-tokens"]["seq"]) == (256, 256, 512)
    assert abs(rows["rtp-cp"]["loss_first"] - rows["rtp"]["loss_first"]) < 1e-4
    for name, sequences in (("rtp", 2), ("rtp-cp", 1), ("rtp-cp-same-tokens", 1)):
        r = rows[name]
        assert abs(r["tokens_per_s"] - sequences * r["seq"] / r["step_s"]) < 1e-6 * r["tokens_per_s"]
        assert r["estimate_gb"] > 0 and r["peak_gb"] > 0
    assert rows["rtp-cp"]["estimate_gb"] < rows["rtp"]["estimate_gb"]  # half the tokens' activations per rank
    assert "N=2: rtp-cp/rtp: peak per rank" in printed and "time per token" in printed
    assert "FSDP2 with torch's context_parallel: not run" in printed


def test_hop_cost_mode_times_a_hop_beside_a_bare_loop_of_the_same_exchanges(tmp_path, capsys):
    from hf_rtp.tools.cli import main

    main(["bench", "--hop-cost", "--world-sizes", "2", "--steps", "20", "--output", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    (row,) = result["rows"]
    # at 2 ranks a forward walk makes 1 hop, a backward walk 1 of weights and 1 of gradient accumulators
    assert row["world_size"] == 2 and row["exchanges_per_walk"] == 3
    assert row["watched_messages_per_hop"] == 2  # a watched hop is one message each way, its header inside
    for key in ("us_per_hop", "cpu_us_per_hop"):  # wall time, and the host thread's own time
        cases = {f"{case} {way}" for case in ("walk", "watched", "bare") for way in ("forward", "backward")}
        assert set(row[key]) == cases
        assert all(t > 0 for t in row[key].values())
        ratio = row[key.replace("us_per_hop", "ratio")]  # each / bare within each rank, the worst rank's
        worst = max(r[key]["watched backward"] / r[key]["bare backward"] for r in row["ranks"])
        assert set(ratio) == cases - {"bare forward", "bare backward"} and ratio["watched backward"] == worst
    assert all("rss_samples" not in r for r in row["ranks"])  # a results file of timings, not of memory samples
    printed = capsys.readouterr().out
    assert "wall time per hop" in printed and "the host thread's CPU time per hop" in printed
