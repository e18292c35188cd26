"""Every file of this repository that the README, DESIGN.md, docs/ and recipes/ (its README and its accelerate
configs' comments) name by its path from the repository's root exists: a renamed or removed file leaves no
pointer behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS, SUFFIXES = "recipes|hf_rtp|tests|docs|benchmarks|notebooks", "py|md|yaml|ipynb|log|txt|json"
PATH = re.compile(rf"\b(?:{FOLDERS})/[\w./-]*\w\.(?:{SUFFIXES})\b")


def _texts() -> dict[str, str]:
    files = [ROOT / "README.md", ROOT / "DESIGN.md", ROOT / "recipes" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


def test_every_path_the_docs_and_recipe_configs_name_exists():
    texts = _texts()
    assert "recipes/configs/cpu.yaml" in texts
    named = {(where, p) for where, text in texts.items() for p in PATH.findall(text)}
    assert len(named) > 50  # the pattern finds the paths the docs are full of
    missing = sorted((where, p) for where, p in named if not (ROOT / p).exists())
    assert not missing, missing
