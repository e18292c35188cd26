"""Each row of the README's "What you call, what happens" table names the tests that show it, and they exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_names_tests_that_exist():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| what you call | what happens | test") : text.index("## Supported models")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what you call")]
    assert len(rows) >= 10
    for row in rows:
        named = re.findall(r"`((?:tests/\w+/)?test_\w+\.py)`", row.rsplit("|", 2)[-2])
        assert named, row
        for name in named:
            path = ROOT / name if name.startswith("tests/") else ROOT / "tests" / "distributed" / name
            assert path.is_file(), (row[:60], name)
