"""Measurements, side by side with DDP, FSDP2 and transformers' tensor parallelism: `main(argv)` is
`hf-rtp bench` (a list of its command-line arguments; returns the results it writes as results.json).

- `options`: the command line; `run`: each strategy's runs and the table; `__main__`: `python -m`'s entry;
- `worker`: one rank of one strategy; `processes` and `rank_server`: how the ranks are started;
- `presets`: model configs made locally; the modes: `budget`, `decode`, `grpo`, `hops`, `load_memory`,
  `cuda_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`hf-rtp bench ARGV...`, in this process. run.py is imported here, not with the package: it brings
    PEFT and bitsandbytes with the bench's worker, and `hf-rtp bench --help` reads only options.py."""
    from .run import main as bench

    return bench(argv)
