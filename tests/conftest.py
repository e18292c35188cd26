import os
import sys

import pytest

# Tests never touch the network: checkpoints are built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))  # `import support` from any test folder

# Longest files first (those of about 20 s or more in `--durations=0`), so that no worker finishes alone.
# `python -m pytest` runs on pytest-xdist workers (`--dist loadfile`: a file's tests and module fixtures stay
# on one worker; `--no-loadscope-reorder`: they take files in this order, not by how many tests a file
# holds). The first two need nothing from each other; the files that resume the session's default run
# wait for it on a lock (support.recipes).
_FIRST = (
    "tests/e2e/test_notebooks.py",
    "tests/faults/test_recipe_faults.py",
    "tests/e2e/test_recipes.py",
    "tests/e2e/test_users_paths.py",  # the GPU check's launches on the CPU: a loop and six recipe launches
    "tests/faults/test_collective_misuse.py",
    "tests/e2e/test_recipe_on_two_nodes.py",
    "tests/e2e/test_bench.py",
    "tests/e2e/test_bench_rank_server.py",
    "tests/e2e/test_recipe_with_trainer_and_qlora.py",
    "tests/e2e/test_trl_sft_script.py",
    "tests/e2e/test_recipe_context_parallel.py",
    "tests/distributed/test_context_parallel.py",
    "tests/distributed/test_context_parallel_seams.py",
    "tests/distributed/test_torchao_optimizer.py",  # over two minutes: last on a worker, it was CI's tail
    "tests/distributed/test_zoo.py",
    "tests/distributed/test_bad_input.py",
    "tests/faults/test_resume_faults.py",
    "tests/distributed/test_qlora.py",
    "tests/distributed/test_8bit_optimizer.py",
    "tests/distributed/test_int8.py",
    "tests/distributed/test_torchao_optimizer.py",
    "tests/distributed/test_two_dimensional.py",
    "tests/distributed/test_two_launchers.py",
    "tests/distributed/test_equivalence.py",
    "tests/distributed/test_trainer.py",
    "tests/faults/test_save_conflicts.py",
    "tests/faults/test_save_faults.py",
    "tests/distributed/test_resize_embeddings.py",
    "tests/e2e/",
    "tests/faults/",
    "tests/distributed/",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, p in enumerate(_FIRST) if item.nodeid.startswith(p)), len(_FIRST)))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory, worker_id):
    """The README's job, shortened (accelerate launch, 2 processes, 8 steps, a checkpoint every 4): built
    once per session and shared by every worker; its folder, with `.seconds` the launch took."""
    from support.recipes import default_run_once

    return default_run_once(tmp_path_factory, worker_id)
