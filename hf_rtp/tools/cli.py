"""The `hf-rtp` command: `hf-rtp bench ...` and `hf-rtp estimate ...`."""

from __future__ import annotations

import sys

USAGE = """usage: hf-rtp {bench,estimate} [options]

  bench     measure single process, DDP, FSDP2, transformers TP and RTP side by side
  estimate  per-rank memory of each strategy from config.json alone

`hf-rtp COMMAND --help` for a command's options."""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .bench.run import main as bench

        bench(rest)
    elif command == "estimate":
        from .memory_qlora import main as estimate

        estimate(rest)
    else:
        raise SystemExit(f"hf-rtp: unknown command {command!r}\n\n{USAGE}")


if __name__ == "__main__":
    main()
