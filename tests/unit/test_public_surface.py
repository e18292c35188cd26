"""hf_rtp's public surface, written down: the names `import hf_rtp` exports, from_pretrained's keywords and
the `hf-rtp` command's options, each with its default. A change to any of them fails here until the lists
below are updated by hand, so that the surface changes on purpose (with the README and the docs), never by
accident. As torchtitan's tests/unit_tests/test_no_new_cli_options.py does for its command line.

The command's help is checked too: every option has some, and `--help` answers without importing PEFT,
bitsandbytes, TRL or matplotlib (bitsandbytes alone prints kernel warnings and takes a second). Importing
the package itself imports torch, transformers and accelerate (api.py needs them), and every `hf-rtp`
call pays for that: what the test holds the command to is that it imports nothing beyond it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hf_rtp
from hf_rtp.tools import cli

UPDATE = (
    "hf_rtp's public surface changed. If that is deliberate, update {what} in tests/unit/test_public_surface.py, "
    "and the README and docs that describe it"
)

PUBLIC_NAMES = [
    "Accelerator",
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "CPUOffloadOptimizer",
    "CheckpointError",
    "CollectiveMisuseError",
    "HfRtpError",
    "IntegrationError",
    "KeywordError",
    "Plan",
    "PlanError",
    "RotatedStateError",
    "SettingError",
    "TopologyError",
    "UnsupportedModelError",
    "UnsyncedGradientsError",
    "adapter_state_dict",
    "attach_trainer",
    "collective_timeout",
    "context_parallel",
    "context_parallel_unshard",
    "from_pretrained",
    "ignore_rotated_in_ddp",
    "is_rotated",
    "load_training_state",
    "local_rows",
    "register",
    "save_training_state",
    "state_of",
    "sync_grads",
    "whole_model",
]

# name -> default; "*" for the required checkpoint, "**" for the keywords passed on to transformers
FROM_PRETRAINED = {
    "pretrained_model_name_or_path": "*",
    "dtype": None,
    "device": None,
    "device_mesh": None,
    "rtp_size": None,
    "plan": None,
    "timeout": None,
    "revision": None,
    "token": None,
    "cache_dir": None,
    "local_files_only": False,
    "rotation_piece_size": "16MB",
    "fused_loss": True,
    "verify_weights": "auto",
    "auto_class": None,
    "reduce_dtype": None,
    "rotation_moves": "auto",
    "tiled_mlp": "auto",
    "kwargs": "**",
}

# command -> option -> default (a positional by its name; -h/--help, which every command has, left out)
CLI = {
    "hf-rtp": {"--version": None},
    "hf-rtp bench": {
        "--checkpoint": None,
        "--preset": "llama-90m",
        "--world-sizes": "2",
        "--strategies": None,
        "--batch": 2,
        "--seq": 128,
        "--warmup": 2,
        "--steps": 5,
        "--dtype": "float32",
        "--device": "cpu",
        "--backend": None,
        "--threads": 1,
        "--output": "bench-out",
        "--timeout": 1800,
        "--gradient-checkpointing": False,
        "--rtp-size": None,
        "--autocast": False,
        "--fsdp2-prefetch": 0,
        "--profile": None,
        "--profile-strategies": "rtp",
        "--load-in-4bit": False,
        "--generate": None,
        "--new-tokens": 128,
        "--grpo": False,
        "--num-generations": 8,
        "--long-sequence": False,
        "--hop-cost": False,
        "--budget-gb": None,
        "--tiled-mlp": "auto",
    },
    "hf-rtp estimate": {
        "model": None,
        "--world-size": None,
        "--rtp-size": None,
        "--batch": 2,
        "--seq": 128,
        "--dtype": "auto",
        "--optimizer": "adamw",
        "--gradient-checkpointing": False,
        "--checkpoint-offload": False,
        "--optimizer-offload": False,
        "--gpus-per-node": 8,
        "--tiled-mlp": "auto",
        "--autocast": False,
        "--attn-implementation": None,
        "--load-in-4bit": False,
        "--lora-rank": 16,
        "--device": "cuda",
        "--speed": False,
        "--json": False,
        "--hardware": "h100",
        "--recompute": None,
        "--flop-rate": None,
        "--link-bandwidth": None,
        "--collective-bandwidth": None,
        "--latency-us": None,
        "--host-hop-us": None,
        "--host-collective-us": None,
        "--time-slice-ms": None,
        "--piece-size": "16MB",
    },
}

NOT_FOR_HELP = ("bitsandbytes", "peft", "trl", "matplotlib")


def commands() -> dict[str, argparse.ArgumentParser]:
    """`hf-rtp`'s parser and each command's, by how it is called."""
    top = cli.parser()
    [sub] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {"hf-rtp": top, **{f"hf-rtp {name}": p for name, p in sub.choices.items()}}


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Its options and positionals, without -h/--help and the commands themselves."""
    return [a for a in p._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def key(action: argparse.Action) -> str:
    return ", ".join(action.option_strings) or action.dest


def default(action: argparse.Action):
    return None if action.default is argparse.SUPPRESS else action.default


def test_the_public_names_are_the_listed_ones():
    assert sorted(hf_rtp.__all__) == sorted(PUBLIC_NAMES), UPDATE.format(what="PUBLIC_NAMES")
    assert len(set(hf_rtp.__all__)) == len(hf_rtp.__all__)
    assert [name for name in PUBLIC_NAMES if not hasattr(hf_rtp, name)] == []


def test_from_pretrained_takes_the_listed_keywords_with_their_defaults():
    found = {}
    for name, p in inspect.signature(hf_rtp.from_pretrained).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            found[name] = "**"
        else:
            found[name] = "*" if p.default is p.empty else p.default
    # the order counts for the one positional; keywords are compared as a set, with their defaults
    assert next(iter(found)) == "pretrained_model_name_or_path"
    assert found == FROM_PRETRAINED, UPDATE.format(what="FROM_PRETRAINED")


def test_the_command_line_has_the_listed_options_with_their_defaults():
    found = {name: {key(a): default(a) for a in options(p)} for name, p in commands().items()}
    assert found == CLI, UPDATE.format(what="CLI")


def test_every_option_of_the_command_line_has_help():
    missing = [
        f"{name} {key(a)}"
        for name, p in commands().items()
        for a in p._actions
        if not a.help or a.help is argparse.SUPPRESS
    ]
    assert missing == []
    top = commands()["hf-rtp"]
    [sub] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert all(choice.help for choice in sub._choices_actions)  # the commands' one-line summaries


# A fresh interpreter: hf_rtp's import first (its cost is not the command's), then the command's answers
# to --help and --version, then every top-level module that was imported since, besides the standard library.
_PROBE = """
import contextlib, io, json, sys
import hf_rtp
before = {m.split(".")[0] for m in sys.modules}
from hf_rtp.tools.cli import main
runs = {}
for argv in (["--help"], ["bench", "--help"], ["estimate", "--help"], ["--version"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
            code = None
        except SystemExit as exit:
            code = exit.code
    runs[" ".join(argv)] = [code, out.getvalue()]
after = {m.split(".")[0] for m in sys.modules}
print(json.dumps({"runs": runs, "added": sorted(after - before - set(sys.stdlib_module_names)),
                  "imported": sorted(after)}))
"""


@pytest.fixture(scope="module")
def probe():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_help_answers_without_importing_more_than_the_package(probe):
    assert probe["added"] == []  # nothing beyond `import hf_rtp`: no PEFT, bitsandbytes, TRL, matplotlib
    assert [m for m in NOT_FOR_HELP if m in probe["imported"]] == []  # nor did the package import them


def test_help_exits_0_and_shows_every_option(probe):
    for name, p in commands().items():
        code, printed = probe["runs"][" ".join([*name.split()[1:], "--help"])]
        assert code == 0, name
        assert printed.startswith(f"usage: {name} "), printed[:200]
        for action in options(p):
            shown = action.option_strings[-1] if action.option_strings else action.dest
            assert shown in printed, (name, shown)
    assert "bench" in probe["runs"]["--help"][1] and "estimate" in probe["runs"]["--help"][1]


def test_version_prints_the_package_version(probe):
    assert probe["runs"]["--version"] == [0, f"hf-rtp {hf_rtp.__version__}\n"]


@pytest.mark.parametrize("argv", [["frobnicate"], [], ["bench", "--no-such-option"], ["estimate"]])
def test_a_wrong_command_line_exits_2_with_the_usage(argv, capsys):
    # before any command runs: nothing is measured, estimated or imported for it
    with pytest.raises(SystemExit) as refused:
        cli.main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hf-rtp") and "error:" in err, err
    if argv[:1] == ["bench"]:
        assert "hf-rtp bench: error: unrecognized arguments: --no-such-option" in err  # the command's own usage


def test_the_command_is_the_installed_entry_point():
    pyproject = (Path(hf_rtp.__file__).parent.parent / "pyproject.toml").read_text()
    assert '\nhf-rtp = "hf_rtp.tools.cli:main"\n' in pyproject
