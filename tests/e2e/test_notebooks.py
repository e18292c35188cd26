"""Every notebook runs top to bottom on CPU (nbclient, a real kernel), and is committed without outputs.

The notebooks assert what they show (ranks hold half the parameters, losses fall, the saved
checkpoint generates the same text in vanilla transformers, a registered plan matches vanilla's
logits), so a notebook that runs is a notebook that still says something true.
"""

import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks")
NAMES = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def test_the_three_notebooks_are_there():
    assert NAMES == ["01_quickstart.ipynb", "02_plans.ipynb", "03_memory.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear the outputs before committing"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' scratch folders go here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_RTP_NOTEBOOK_WORLD_SIZES", "2")  # 03_memory's bench at 2 ranks only: test_bench covers more
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images or name == "02_plans.ipynb", "the plots did not render"
