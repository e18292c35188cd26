"""Run a script as one of several ranks that share GPU 0 (the GPU check's launched recipes, users_recipes.py).

    accelerate launch --config_file recipes/configs/gpu.yaml --num_processes 2 tests/gpu/one_gpu.py SCRIPT ARGS...

accelerate gives each process `cuda:(LOCAL_RANK % device_count)`, which is GPU 0 for every rank of a machine with
one GPU, but its `wait_for_everyone` calls `barrier(device_ids=[LOCAL_RANK])`: on rank 1 that names a GPU the
machine lacks. Two ranks on one GPU are an artifact of the check, not a layout users run, so here every rank is its
node's local rank 0 (hf_rtp, accelerate and Trainer then all use GPU 0) and the script runs unchanged, as
`python SCRIPT ARGS...` would run it. A rank keeps its global RANK: only "which GPU of this node" changes.
With as many GPUs as ranks, or on the CPU, the wrapper changes nothing.
"""

from __future__ import annotations

import os
import runpy
import sys


def shared_gpu() -> bool:
    """Whether this rank must share GPU 0: more local ranks than visible GPUs."""
    try:
        import torch
    except ImportError:
        return False
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return torch.cuda.is_available() and torch.cuda.device_count() < ranks


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: one_gpu.py SCRIPT [ARGS...]")
    if shared_gpu():
        os.environ["LOCAL_RANK"] = "0"
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts its folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
