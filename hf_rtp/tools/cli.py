"""The `hf-rtp` command: `hf-rtp bench ...` and `hf-rtp estimate ...`.

Each command's options are read from a module that imports nothing beyond what `import hf_rtp` has
already imported (bench/options.py; memory.py, memory_qlora.py, speed.py and speed_report.py, the estimate itself); the
bench's own module, which brings PEFT, bitsandbytes, TRL or matplotlib with it, is imported once the arguments
parse. So `--help`, `--version` and a mistyped option answer without those imports, and without bitsandbytes'
import-time warnings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..version import __version__
from . import memory, memory_qlora, speed_report
from .bench import options as bench_options


def parser() -> argparse.ArgumentParser:
    """`hf-rtp`'s parser, with a subparser for each command (tests/unit/test_public_surface.py lists their
    options: the command line is public)."""
    p = argparse.ArgumentParser(
        prog="hf-rtp",
        description="Rotated Tensor Parallelism for Hugging Face transformers: measure and estimate.",
        epilog="`hf-rtp COMMAND --help` for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit")
    commands = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands", help="what to run; one of:"
    )
    raw = argparse.RawDescriptionHelpFormatter
    bench = commands.add_parser(
        "bench",
        help="measure single process, DDP, FSDP2, transformers TP and RTP side by side",
        description=bench_options.__doc__,
        formatter_class=raw,
    )
    bench_options.add_arguments(bench)
    estimate = commands.add_parser(
        "estimate",
        help="per-rank memory of each strategy from config.json alone; with --speed, step time per GPU",
        description=memory.__doc__,
        formatter_class=raw,
    )
    memory.add_arguments(estimate)
    speed_report.add_arguments(estimate)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --help, --version, an unknown command, a missing argument: argparse answers here (exit 0, or 2 with
    # the usage), before any command's module is imported
    args, _ = parser().parse_known_args(argv)
    rest = argv[argv.index(args.command) + 1 :]
    # an unknown option too, under the command's own usage (hf-rtp's parser would show its own)
    {"bench": bench_options.parser, "estimate": memory_qlora.parser}[args.command]().parse_args(rest)
    if args.command == "bench":
        from .bench.run import main as bench

        bench(rest)  # parses `rest` again; the results it returns are for Python callers (hf_rtp.tools.bench)
    else:
        memory_qlora.main(rest)


if __name__ == "__main__":
    main()
