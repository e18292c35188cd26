"""The GPU check's tests (`.ci/gpu`; docs/testing.md, "On a GPU").

Every test under tests/gpu carries the `gpu` marker (pyproject.toml registers it), so `pytest -m gpu` selects
them all, also those of a file that forgot the marker. A test that needs CUDA skips itself without it (its
module's `pytestmark`), so the CPU suite collects these files and skips them at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
