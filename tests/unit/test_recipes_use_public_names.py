"""What users copy from recipes/ and notebooks/ uses only hf_rtp's public names: `hf_rtp.<name in
__all__>`, and the public modules below. A planted snippet shows the checker catches an internal one."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import hf_rtp

ROOT = Path(hf_rtp.__file__).parent.parent
PUBLIC_MODULES = {"hf_rtp", "hf_rtp.plans", "hf_rtp.tools", "hf_rtp.tools.memory", "hf_rtp.tools.bench"}
PUBLIC_NAMES = {*hf_rtp.__all__, "plans", "tools", "__version__"}


def sources() -> dict[str, str]:
    found = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "recipes").glob("*.py"))}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        code = [("".join(c["source"])) for c in cells if c["cell_type"] == "code"]
        found[str(notebook.relative_to(ROOT))] = "\n".join(code)
    return found


def internal_uses(code: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_rtp"):
            if node.module not in PUBLIC_MODULES:
                found.append(f"from {node.module} import ...")
            elif node.module == "hf_rtp":
                found += [f"hf_rtp.{a.name}" for a in node.names if a.name not in PUBLIC_NAMES]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("hf_rtp") and a.name not in PUBLIC_MODULES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hf_rtp":
            found += [f"hf_rtp.{node.attr}"] if node.attr not in PUBLIC_NAMES else []
    return found


def test_recipes_and_notebooks_use_only_public_names():
    uses = {name: internal_uses(code) for name, code in sources().items()}
    assert len(uses) >= 6  # the recipes and the three notebooks were read
    assert {name: found for name, found in uses.items() if found} == {}


def test_the_checker_finds_internal_names():
    planted = (
        "import hf_rtp\n"
        "from hf_rtp.checkpoint.save import upload_folder\n"
        "from hf_rtp import sync_grads, settings\n"
        "hf_rtp.state_of(m).topology\n"
        "hf_rtp.distributed.tensors.sharding.chunk_rows(4, 2, 0)\n"
    )
    assert sorted(internal_uses(planted)) == [
        "from hf_rtp.checkpoint.save import ...",
        "hf_rtp.distributed",
        "hf_rtp.settings",
    ]
