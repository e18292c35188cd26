import os
import sys

# Tests never touch the network: checkpoints are built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))  # `import support` from any test folder
