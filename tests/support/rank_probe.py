"""A bench rank for the rank server's tests: reports how it started, fails, or stops itself, as told."""

import json
import os
import signal
import sys

import hf_rtp.tools.bench.worker  # noqa: F401  # what the rank server preloads: a fresh rank imports the same


def main(args):
    if args == ["fail"]:
        raise SystemExit("this rank failed on purpose")
    if args == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)  # a rank that never finishes
    import torch

    with open("/proc/self/status") as f:
        rss = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "RssFile")}
    seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")}
    print(json.dumps({**rss, **seen, "cuda_initialized": torch.cuda.is_initialized(), "pid": os.getpid()}))


if __name__ == "__main__":
    main(sys.argv[1:])
