import os
import sys

# Tests never touch the network: checkpoints are built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))  # `import support` from any test folder

# Longest files first. `python -m pytest` runs on two workers (pytest-xdist, `--dist loadfile`: a file's
# tests and its module fixtures stay on one worker), which take files in this order: the long launches of
# the recipes start early and the short files fill in beside them, instead of one worker finishing alone.
_FIRST = ("tests/e2e/test_recipes.py", "tests/e2e/", "tests/faults/", "tests/distributed/")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, p in enumerate(_FIRST) if item.nodeid.startswith(p)), len(_FIRST)))
