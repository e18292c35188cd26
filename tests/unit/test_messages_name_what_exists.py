"""Every `hf_rtp.<name>` the package's strings tell a user about exists: its errors, warnings, help and docstrings
name hf_rtp's public names (`hf_rtp.__all__`), or a module of the package and what it holds. A refusal once told
users to save through `hf_rtp.Trainer`, which never existed; this scan keeps such a name from coming back."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import hf_rtp
from hf_rtp.checkpoint.digests import DIGESTS_KEY, SIZE_KEY

PACKAGE = Path(hf_rtp.__file__).resolve().parent
NAMED = re.compile(r"\bhf_rtp((?:\.[A-Za-z_]\w*)+)(\.\.\.)?")
NOT_API = {SIZE_KEY, DIGESTS_KEY}  # the keys of hf_rtp's metadata in a saved safetensors header, not names to call


def strings(path: Path) -> list[tuple[int, str]]:
    """Every string literal of a module, f-strings' literal parts and docstrings included, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
    return found


def named(text: str) -> list[str]:
    """The dotted names after `hf_rtp.` in `text` ("AutoModelFor..." for the family the text abbreviates)."""
    return [
        dotted.strip(".") + ("..." if family else "")
        for dotted, family in NAMED.findall(text)
        if f"hf_rtp{dotted}" not in NOT_API
    ]


def resolves(dotted: str) -> bool:
    """`hf_rtp.<dotted>` is a public name, or a module of the package, followed by attributes that exist."""
    first, *rest = dotted.split(".")
    if dotted.endswith("..."):  # hf_rtp.AutoModelFor....from_pretrained: some public name of that family
        prefix = dotted.removesuffix("...")
        return any(name.startswith(prefix) for name in hf_rtp.__all__)
    if first in hf_rtp.__all__ or first == "__version__":
        target = getattr(hf_rtp, first)
    else:
        try:
            target = importlib.import_module(f"hf_rtp.{first}")
        except ModuleNotFoundError:
            return False
    for part in rest:
        if hasattr(target, part):
            target = getattr(target, part)
            continue
        try:
            target = importlib.import_module(f"{target.__name__}.{part}")
        except (AttributeError, ModuleNotFoundError):
            return False
    return True


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_scan_finds_the_names_the_messages_use():
    """A scan that found nothing would pass without a word: the refusals name these."""
    everything = {name for path in MODULES for _, text in strings(path) for name in named(text)}
    assert {"from_pretrained", "save_training_state", "Accelerator", "sync_grads"} <= everything
    assert not resolves("Trainer") and not resolves("tools.no_such_module") and not resolves("Accelerator.no_such")
    assert resolves("tools.memory_qlora.main") and resolves("AutoModelFor...") and resolves("plans.register")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_hf_rtp_name_a_message_gives_exists(path):
    wrong = [(line, name) for line, text in strings(path) for name in named(text) if not resolves(name)]
    assert wrong == [], f"{path.relative_to(PACKAGE)} names hf_rtp API that does not exist: {wrong}"
