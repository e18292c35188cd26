"""Numbers the README and docs state about the tests are computed here from the tests and the fault table and
must be what the text says: the injected faults (docs/reliability.md's table, summed), the families checked at
2 and 3 ranks (tests/support/zoo.py's ZOO and AT_THREE, which tests/distributed/test_zoo.py runs), and
docs/architectures.md's plan and ranks columns."""

from __future__ import annotations

import re
from pathlib import Path

from support.zoo import AT_THREE, AUTO, ZOO

from hf_rtp.faults import POINTS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _fault_table() -> tuple[list[list[int]], list[int]]:
    """docs/reliability.md's fault table: each case row's counts (tried, clear error, loaded as vanilla, hangs,
    silent results, checkpoints lost; an empty cell is 0) and the total row's."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    start = text.index("| cases | tried |")
    lines = text[start:].splitlines()[2:]
    rows, total = [], None
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        counts = [int(c) if c else 0 for c in cells[1:]]
        if cells[0] == "total":
            total = counts
        else:
            rows.append(counts)
    assert total is not None and len(rows) >= 10
    return rows, total


def test_the_fault_tables_total_is_its_rows_summed_and_each_case_has_one_outcome():
    rows, total = _fault_table()
    assert [sum(column) for column in zip(*rows, strict=True)] == total
    for row in rows:
        assert row[0] == sum(row[1:]), row  # every case tried ends in exactly one of the outcome columns


def test_the_readme_states_the_number_of_injected_faults_the_table_counts():
    _, total = _fault_table()
    (stated,) = re.findall(r"(\d+) injected faults", README)
    assert int(stated) == total[0]


def test_every_fault_point_is_one_some_test_injects():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for point in POINTS:  # "kill@save.commit#1", or f"{action}@forward#1:3"
        assert re.search(r"(?:kill|stop|raise|corrupt|\})@" + re.escape(point) + r"(?![\w.])", sources), point


def _architecture_rows() -> dict[str, tuple[str, str]]:
    """docs/architectures.md's family table: model_type -> (plan, ranks)."""
    text = (ROOT / "docs" / "architectures.md").read_text()
    found = {}
    for line in text.splitlines():
        match = re.match(r"\| [^|]*\(`(\w+)`\) \| `(\w+)` \|.*\| ([^|]+) \|$", line)
        if match:
            found[match.group(1)] = (match.group(2), match.group(3).strip())
    return found


def test_the_architectures_table_lists_the_zoo_with_its_plans_and_the_ranks_each_family_runs_at():
    rows = _architecture_rows()
    assert sorted(rows) == sorted(model_type for model_type, _ in ZOO.values())
    for name, (model_type, _) in ZOO.items():
        plan, ranks = rows[model_type]
        assert plan == ("auto" if name in AUTO else model_type), name
        assert ranks == ("2, **3**" if name in AT_THREE else "2"), name


def test_the_readme_counts_the_families_checked_at_2_and_at_3_ranks():
    stated = re.search(r"all (\d+) families at 2 ranks and (\d+) of them also at 3", README).groups()
    assert tuple(map(int, stated)) == (len(ZOO), len(AT_THREE))
    registered = re.search(r"\*\*Registered plans:\*\*(.*?)\.\n", README, re.S).group(1)
    auto = re.search(r'\*\*`plan="auto"`:\*\*(.*?), and your own architecture', README, re.S).group(1)
    assert len(registered.split(",")) == len(ZOO) - len(AUTO)
    assert len(auto.split(",")) == len(AUTO)
