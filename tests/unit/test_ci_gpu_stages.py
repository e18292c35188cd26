""".ci/gpu's stages and summary (.ci/gpu-stages.sh, which .ci/gpu sources), run on fake stages on any machine: a
stage whose tests all skipped, or that says it cannot run here, reads "skipped" and fails the check unless declared
--may-skip; a passing stage with some tests skipped says how many; failures, timeouts and stages the time did not
reach fail it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ROOT / ".ci" / "gpu-stages.sh"

ALL_SKIP = """import pytest

@pytest.mark.skip(reason="needs an NVIDIA GPU")
def test_a():
    pass

@pytest.mark.skip(reason="needs an NVIDIA GPU")
def test_b():
    pass
"""
SOME_SKIP = """import pytest

def test_a():
    assert 1 + 1 == 2

@pytest.mark.skip(reason="needs the NCCL world")
def test_b():
    pass
"""


def _check(tmp_path, stages: str, total_s: int = 60) -> tuple[int, list[str]]:
    """Source the library, run `stages` (bash lines calling `stage`), then `summary`: (its status, the summary)."""
    (tmp_path / "test_all_skip.py").write_text(ALL_SKIP)
    (tmp_path / "test_some_skip.py").write_text(SOME_SKIP)
    (tmp_path / "work").mkdir(exist_ok=True)
    pytest_cmd = f"{sys.executable} -m pytest -q -p no:cacheprovider -o addopts= --rootdir {tmp_path}"
    script = f"""
set -uo pipefail
LOG={tmp_path}/check.log WORK={tmp_path}/work TOTAL_S={total_s} START=$SECONDS PYTEST="{pytest_cmd}"
source {STAGES}
{stages}
summary
"""
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""}
    )
    lines = done.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if re.match(r"=== \.ci/gpu: \d+ s", line))
    return done.returncode, lines[start + 1 :]


def _status(summary: list[str], name: str) -> str:
    line = next(line for line in summary if line.startswith(name + " "))
    return line[len(name) :].split(" s  ", 1)[1].strip()


def test_a_stage_whose_tests_all_skipped_reads_skipped_and_fails_the_check(tmp_path):
    status, summary = _check(
        tmp_path,
        f"""stage passing 20 true
stage gpu-tests 30 $PYTEST {tmp_path}/test_all_skip.py""",
    )
    assert status == 1
    assert _status(summary, "passing").startswith("ok")
    assert _status(summary, "gpu-tests").startswith("SKIPPED: must run on a GPU")
    assert summary[-1].startswith("=== .ci/gpu: FAILED")


def test_a_command_that_cannot_run_here_reads_skipped_and_may_skip_only_where_declared(tmp_path):
    status, summary = _check(
        tmp_path,
        """stage --may-skip optional 10 bash -c 'echo "skipped: no TRL here"; exit 77'
stage users-loop 10 bash -c 'echo "skipped: needs the NCCL world"; exit 77'""",
    )
    assert status == 1
    assert _status(summary, "optional").startswith("skipped")
    assert _status(summary, "users-loop").startswith("SKIPPED: must run on a GPU")
    assert summary[-2].startswith("users-loop") and summary[-2].endswith("skipped: needs the NCCL world")


def test_every_stage_passing_passes_and_a_partial_skip_is_counted(tmp_path):
    status, summary = _check(
        tmp_path,
        f"""stage tests 30 $PYTEST {tmp_path}/test_some_skip.py
stage --may-skip optional 10 bash -c 'exit 77'""",
    )
    assert status == 0, summary
    assert _status(summary, "tests").startswith("ok, 1 skipped")
    assert summary[-1] == "=== .ci/gpu: every stage ran and passed"


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ("stage broken 10 false", "FAILED (exit 1)"),
        ("stage hangs 5 sleep 60", "TIMEOUT"),
        ("stage none 60 $PYTEST -k nothing_matches $WORK/../test_some_skip.py", "SKIPPED"),
    ],
)
def test_failures_timeouts_and_empty_stages_fail_the_check(tmp_path, stages, expected):
    status, summary = _check(tmp_path, stages)
    assert status == 1 and expected in summary[0], summary


def test_a_stage_the_time_does_not_reach_is_not_run_and_fails(tmp_path):
    status, summary = _check(tmp_path, "stage first 10 sleep 3\nstage second 10 true", total_s=6)
    assert status == 1
    assert _status(summary, "first").startswith("ok")
    assert _status(summary, "second") == "NOT RUN: the check's time was spent"


def test_ci_gpu_runs_its_stages_through_the_library():
    text = (ROOT / ".ci" / "gpu").read_text()
    assert "source .ci/gpu-stages.sh" in text and "\nstage() {" not in text
    assert "summary | tee" in text
    # the users' paths run first, each a stage of its own
    order = [text.index(f"stage {name} ") for name in ("versions", "users-loop", "recipes", "trl", "tests", "bench")]
    assert order == sorted(order)


def test_a_selection_runs_only_the_named_stages_and_versions_and_says_the_check_was_partial(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RTP_GPU_STAGES", "recipes,trl")
    status, summary = _check(tmp_path, "stage versions 5 true\nstage users-loop 5 false\nstage recipes 5 true")
    assert status == 0, summary
    assert _status(summary, "versions").startswith("ok") and _status(summary, "recipes").startswith("ok")
    assert _status(summary, "users-loop") == "not selected (HF_RTP_GPU_STAGES)"
    assert summary[-1].startswith("=== .ci/gpu: the selected stages passed; 1 not selected")
    status, summary = _check(tmp_path, "stage recipes 5 false")  # a selected stage that fails still fails it
    assert status == 1 and summary[-1].startswith("=== .ci/gpu: FAILED")
