""".ci/gpu-speed on the CPU: what a lent GPU's one call will run, checked where no GPU is.

Its own check (GPU_SPEED_DEVICE=cpu) runs every stage at a tiny shape over gloo, under a stand-in for
nvidia-cuda-mps-control that records what it was told: the daemon started with its pipe and log in the script's
temporary folder, asked which servers ran, and told to quit on every way out.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
SCRIPT = os.path.join(ROOT, ".ci", "gpu-speed")

STAND_IN = """#!/usr/bin/env bash
# nvidia-cuda-mps-control's stand-in: each call and command it gets, a line in $FAKE_MPS_LOG
if [ "${1:-}" = -d ]; then
  echo "-d pipe=${CUDA_MPS_PIPE_DIRECTORY:-} log=${CUDA_MPS_LOG_DIRECTORY:-}" >>"$FAKE_MPS_LOG"
  exit "${FAKE_MPS_START_RC:-0}"
fi
while read -r command; do
  echo "$command" >>"$FAKE_MPS_LOG"
  if [ "$command" = get_server_list ] && [ -n "${FAKE_MPS_SERVER:-}" ]; then echo "$FAKE_MPS_SERVER"; fi
done
"""


def _env(tmp_path, server: str | None, **extra: str) -> dict:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    stand_in = folder / "nvidia-cuda-mps-control"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(
        os.environ,
        PATH=f"{folder}{os.pathsep}{os.environ['PATH']}",
        PYTHON=sys.executable,
        FAKE_MPS_LOG=str(tmp_path / "mps.log"),
        OUT=str(tmp_path / "out"),
        TMPDIR=str(tmp_path / "tmp"),  # the preset's checkpoint and the script's own folder
        GPU_SPEED_DEVICE="cpu",
        **extra,
    )
    env.pop("FAKE_MPS_SERVER", None)
    if server is not None:
        env["FAKE_MPS_SERVER"] = server
    return env


def _mps_calls(tmp_path) -> list[str]:
    return (tmp_path / "mps.log").read_text().splitlines()


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU"
)
def test_without_a_gpu_it_says_it_needs_cuda_and_fails(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    env.pop("GPU_SPEED_DEVICE", None)
    done = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert ".ci/gpu-speed needs CUDA" in done.stdout
    assert not (tmp_path / "out").exists()  # nothing written, no daemon started


def test_the_dry_run_prints_one_bench_command_at_the_issues_shape(tmp_path):
    from hf_rtp.tools.bench import options

    env = dict(os.environ, PYTHON="python3", PATH="/usr/bin:/bin")  # no nvidia-cuda-mps-control on this PATH
    env.pop("GPU_SPEED_DEVICE", None)
    done = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "CUDA MPS: no nvidia-cuda-mps-control on PATH: would run time-sliced" in done.stdout
    [line] = [line for line in done.stdout.splitlines() if line.startswith("bench: ")]
    argv = shlex.split(line.removeprefix("bench: "))
    assert argv[:4] == ["python3", "-m", "hf_rtp", "bench"]
    args = options.parser().parse_args(argv[4:])  # hf-rtp bench takes it as it stands
    assert args.preset == "llama-1b" and args.world_sizes == "2" and args.device == "cuda:0"
    assert args.strategies.split(",") == ["rtp", "rtp-offload", "fsdp2", "ddp"]  # RTP first, should time run out
    assert 1 <= args.batch <= 2 and 2048 <= args.seq <= 4096  # 1-2 sequences of 2048-4096 tokens per rank
    assert args.gradient_checkpointing and args.autocast and args.dtype == "float32"
    assert args.threads == 8  # GPU_SPEED_THREADS unset: 8 a rank on a GPU, for rtp-offload's host step
    assert args.fsdp2_prefetch == 0  # FSDP2's implicit prefetch, as torchtitan's dense Llama runs it
    assert args.profile and args.profile_strategies == "rtp"
    hops = next(line for line in done.stdout.splitlines() if line.startswith("hops: "))
    assert "benchmarks/hop_latency_cuda.py --device cuda:0" in hops


def test_its_own_check_runs_every_stage_under_mps_and_stops_it(tmp_path):
    done = subprocess.run(
        ["bash", SCRIPT], capture_output=True, text=True, errors="replace", env=_env(tmp_path, "4242"), timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    out = tmp_path / "out"

    # the daemon: started with its pipe and log in the script's temporary folder, asked, told to quit, once
    calls = _mps_calls(tmp_path)
    assert calls[0].startswith("-d pipe=" + str(tmp_path / "tmp")) and calls[1:] == ["get_server_list", "quit"]
    assert not list((tmp_path / "tmp").glob("tmp.*"))  # the script's own folder (mktemp's) is gone

    summary = json.loads((out / "gpu-speed-cpu.json").read_text())
    bench = json.loads((out / "gpu-speed-cpu-bench.json").read_text())
    assert summary["mps"]["on"] is True and "4242" in summary["mps"]["why"]
    assert bench["failed"] == [] and set(summary["strategies"]) == {"rtp", "rtp-offload", "fsdp2", "ddp"}
    rows = {r["strategy"]: r for r in bench["results"]}
    for name in ("fsdp2", "ddp"):  # the summary's ratios are the bench's own figures divided
        assert summary["ratios"][name]["tokens_per_s"] == rows["rtp"]["tokens_per_s"] / rows[name]["tokens_per_s"]
        assert summary["ratios"][name]["peak"] == rows["rtp"]["peak_gb"] / rows[name]["peak_gb"]
    # rtp-offload (hf_rtp.CPUOffloadOptimizer) against rtp: the same tokens a step, so the step time's ratio is
    # the tokens/s' inverted; the memory saved is the worst ranks' peaks' difference
    offload, off = summary["offload"], rows["rtp-offload"]
    assert offload["not_run"] == [] and offload["host_threads"] == 1
    assert offload["step_time"] == rows["rtp"]["tokens_per_s"] / off["tokens_per_s"] > 0
    assert offload["saved_gb"] == rows["rtp"]["peak_gb"] - off["peak_gb"]
    assert offload["peak"] == off["peak_gb"] / rows["rtp"]["peak_gb"] > 0
    assert summary["goals"]["offload_step_time"]["ratio"] == offload["step_time"]
    assert isinstance(summary["goals"]["offload_step_time"]["met"], bool)
    assert off["estimate_gb"] > 0  # hf-rtp estimate's rtp-offload row beside it
    assert off["loss_first"] == rows["rtp"]["loss_first"]  # the same model and first batch, only the optimizer moved
    for name, row in summary["strategies"].items():
        assert len(row["peak_gb_per_rank"]) == 2 and max(row["peak_gb_per_rank"]) == rows[name]["peak_gb"]
    # FSDP2 as the issue asks: a unit per decoder layer (2) and the root, implicit prefetch
    assert summary["strategies"]["fsdp2"]["fsdp2"]["units"] == 3
    assert summary["strategies"]["fsdp2"]["fsdp2"]["prefetch"] == "implicit"
    shape = summary["shape"]
    assert (shape["autocast"], shape["weights"], shape["gradient_checkpointing"]) == ("bfloat16", "float32", True)
    assert shape["world_size"] == "2" and shape["parameters"] > 0
    assert summary["environment"]["torch"] and summary["environment"]["backend"] == "gloo"
    assert summary["hop_host_us"]["65536"]["watched_us"] > 0

    # both ranks of RTP profiled: a trace holding the step's phases, and the ops' table
    profile = out / "gpu-speed-cpu-profile"
    for rank in (0, 1):
        with gzip.open(profile / f"rtp-rank{rank}.json.gz", "rt") as f:
            names = {event.get("name") for event in json.load(f)["traceEvents"]}
        assert {"bench: forward", "bench: backward", "bench: optimizer step"} <= names
        assert "bench: backward" in (profile / f"rtp-rank{rank}-key-averages.txt").read_text()
    # what the device tool brings back from $OUT: at most 8 files, at most 2 folders down, none over 16 MiB
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
    assert len(files) <= 8 and all(os.path.relpath(f, out).count(os.sep) <= 2 for f in files)
    assert all(os.path.getsize(f) <= 16 << 20 for f in files)
    log = (out / "gpu-speed-cpu.log").read_text()
    assert "goal: rtp's tokens/s >= 0.9x FSDP2's" in log and "rtp/ddp: tokens/s" in log
    assert "rtp-offload/rtp: step time " in log and "goal: rtp's step time with CPUOffloadOptimizer <= 1.3x" in log
    assert "host time per watched hop (goal <= 50 us)" in log


def _until_bench_runs(proc, log) -> None:
    deadline = time.monotonic() + 300
    while not (log.exists() and "running rtp on 2 rank(s)" in log.read_text()):
        assert proc.poll() is None, "the script ended before its bench ran"
        assert time.monotonic() < deadline, "the bench did not start"
        time.sleep(0.5)


def _ranks_of(tmp_path) -> list[str]:
    """Processes still running this test's bench (their command lines name its preset's folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().decode(errors="replace")
        except OSError:
            continue
        if str(tmp_path / "tmp") in line and "hf_rtp" in line:
            found.append(pid)
    return found


def test_a_signal_mid_bench_ends_the_bench_then_stops_mps(tmp_path):
    proc = subprocess.Popen(["bash", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(tmp_path, "7"))
    _until_bench_runs(proc, tmp_path / "out" / "gpu-speed-cpu.log")
    proc.send_signal(signal.SIGTERM)  # to the script alone, as a ^C or a scheduler's TERM would come
    output = proc.communicate(timeout=120)[0].decode(errors="replace")
    assert proc.returncode == 143, output
    assert "stopped the stage running" in output and "MPS: stopped" in output
    assert _mps_calls(tmp_path)[1:] == ["get_server_list", "quit"]
    assert _ranks_of(tmp_path) == []  # the bench's ranks ended with it, before MPS was stopped
    assert not list((tmp_path / "tmp").glob("tmp.*"))  # the script's own folder (mktemp's), MPS's pipe in it, gone


def test_mps_that_serves_no_client_is_stopped_and_the_run_goes_on_time_sliced(tmp_path):
    proc = subprocess.Popen(
        ["bash", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(tmp_path, None)
    )
    log = tmp_path / "out" / "gpu-speed-cpu.log"
    _until_bench_runs(proc, log)
    assert "CUDA MPS: off (" in log.read_text() and "stopped, time-sliced" in log.read_text()
    assert _mps_calls(tmp_path)[1:] == ["get_server_list", "quit"]  # stopped before the bench began
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert _mps_calls(tmp_path)[1:] == ["get_server_list", "quit"]  # and not told to quit twice
