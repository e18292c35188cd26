"""hf_rtp's layers import only downward (DESIGN.md), and no module imports itself back through others.

Every import statement counts, function-local ones included: an import hidden in a function is a cycle
all the same, it only fails later. The checker is tried on a small package built here, so that a
checker that finds nothing cannot pass unnoticed. The layers are read from DESIGN.md's table, the one
place the layout is written down, and the table must name every module of the tree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_rtp

PACKAGE = Path(hf_rtp.__file__).parent
DESIGN = PACKAGE.parent / "DESIGN.md"


def design_rows(text: str) -> list[tuple[str, tuple[str, ...], set[str]]]:
    """DESIGN.md's layer table, lowest first: (layer name, its files and folders as module prefixes, the
    names its second column spells in backticks). `__init__.py` is the prefix "" (the public names)."""
    table = text[text.index("| layer | what it holds | may import |") :].split("\n\n")[0].splitlines()[2:]
    rows = []
    for line in table:
        where, what, _ = (cell.strip() for cell in line.strip("|").split("|"))
        paths = re.findall(r"`([^`]+)`", where)
        prefixes = tuple("" if p == "__init__.py" else p.removesuffix(".py").removesuffix("/") for p in paths)
        name = "base" if where.startswith("base:") else prefixes[0]
        rows.append((name, prefixes, {n.removesuffix("/") for n in re.findall(r"`([^`]+)`", what)}))
    return rows


# Lowest first: a module may import its own layer and the ones before it.
LAYERS = [(name, prefixes) for name, prefixes, _ in design_rows(DESIGN.read_text())]
# distributed/ is plain torch.distributed: it must run (and be read) without transformers or its ecosystem
NOT_IN_DISTRIBUTED = ("transformers", "accelerate", "peft", "trl", "huggingface_hub", "safetensors")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of the package, top-level outside packages) that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # `from . import faults` imports the module faults; `from .x import y` imports x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known:
                if target != name:
                    inside.add(target)
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def layer_of(name: str, top: str) -> int:
    rest = name[len(top) + 1 :] if name != top else ""
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rest == prefix or (prefix and rest.startswith(prefix + ".")):
                return rank
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS and to DESIGN.md")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def problems(root: Path) -> list[str]:
    top = root.name
    known = modules(root)
    graph, outside = {}, {}
    for name, path in known.items():
        graph[name], outside[name] = imports(name, path, known)
    found = [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for name, targets in sorted(graph.items()):
        mine = layer_of(name, top)
        for target in sorted(targets):
            theirs = layer_of(target, top)
            if theirs > mine:
                found.append(f"{name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), a layer above it")
    distributed = [n for n in known if layer_of(n, top) == 1]
    for name in distributed:
        reached, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in reached:
                reached.add(current)
                todo.extend(graph[current])
        banned = sorted({m for r in reached for m in outside[r] if m in NOT_IN_DISTRIBUTED})
        if banned:
            found.append(f"{name} (distributed) reaches {', '.join(banned)}")
    return found


def test_hf_rtp_imports_only_downward_and_has_no_cycle():
    assert problems(PACKAGE) == []


def test_design_md_names_every_module_of_the_tree():
    """Each folder's modules and subfolders are named in its row; every file a row names exists."""
    missing = []
    for name, prefixes, named in design_rows(DESIGN.read_text()):
        for prefix in prefixes:
            path = PACKAGE / prefix
            if prefix and path.is_dir():
                found = {p.stem for p in path.glob("*.py") if p.stem != "__init__"}
                found |= {p.name for p in path.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
                missing += [f"{prefix}/{m} (layer {name})" for m in sorted(found - named)]
            elif not (PACKAGE / f"{prefix or '__init__'}.py").exists():
                missing.append(f"{prefix}.py is in DESIGN.md but not in the tree")
    assert missing == []
    assert [name for name, _ in LAYERS] == [
        "base", "distributed", "folders", "layers", "plans", "model", "checkpoint", "training_state", "integrations",
        "api", "tools",
    ]  # fmt: skip


def test_every_subpackage_names_its_modules_in_its_docstring():
    """A folder inside a layer's folder (distributed/transport/, model/context/, ...) is one row of DESIGN.md's
    table in one word; its `__init__.py` docstring is where its modules are named, each in backticks."""
    missing = []
    for init in sorted(PACKAGE.glob("*/*/__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"`([^`]+)`", doc))
        found = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        missing += [f"{folder.relative_to(PACKAGE)}/{m}" for m in sorted(found - named)]
    assert missing == []


def test_only_the_ring_posts_point_to_point_messages():
    """DESIGN.md: only distributed/transport/ring.py sends or receives point to point; every other module of
    the package asks it to (a save's rows, a walk's tokens), so the hop's posting, headers and watch are one place."""
    names = {"isend", "irecv", "batch_isend_irecv", "P2POp", "send", "recv", "send_object_list", "recv_object_list"}

    def posts(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in names:
                return True
        return False

    posting = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "tools" not in path.relative_to(PACKAGE).parts and posts(path)
    )
    assert posting == ["distributed/transport/ring.py"]


def test_the_checker_finds_a_hidden_cycle_an_upward_import_and_transformers_in_distributed(tmp_path):
    package = tmp_path / "pkg"
    for folder in ("", "distributed", "model", "tools"):
        (package / folder).mkdir(parents=True, exist_ok=True)
        (package / folder / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "distributed" / "ring.py").write_text("from .. import errors\nfrom .groups import make\n")
    (package / "distributed" / "groups.py").write_text(
        "from ..log import x\ndef make():\n    from .ring import Ring  # hidden\n"
    )
    (package / "log.py").write_text("import transformers.utils\n")
    (package / "model" / "state.py").write_text("def f():\n    from ..tools import cli\n")
    (package / "tools" / "cli.py").write_text("import os\n")
    found = problems(package)
    assert "import cycle: pkg.distributed.groups -> pkg.distributed.ring" in found
    assert "pkg.model.state (model) imports pkg.tools.cli (tools), a layer above it" in found
    assert "pkg.distributed.groups (distributed) reaches transformers" in found
    assert "pkg.distributed.ring (distributed) reaches transformers" in found
    assert len(found) == 4, found


def test_every_folder_of_the_package_is_a_regular_package():
    """setuptools' find_packages installs only folders with an __init__.py: a namespace folder imports from
    a checkout and is missing from the wheel."""
    root = Path(hf_rtp.__file__).parent
    folders = {path.parent for path in root.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(root)) for f in folders if not (f / "__init__.py").exists()) == []
