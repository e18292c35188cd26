"""accelerate's private names hf_rtp uses (DESIGN.md, "Private names"): the lists of what an Accelerator
prepared, which its save_state and load_state walk on the main process."""

from __future__ import annotations

from typing import Any

import accelerate

from .gate import lookup

TESTED = ">=1.15,<1.16"  # pyproject.toml's bounds


def state_exists() -> bool:
    """Whether an Accelerator (or PartialState) was built in this process: its shared state is set."""
    from accelerate.state import PartialState

    return bool(lookup(PartialState, "_shared_state", "accelerate", accelerate.__version__, TESTED))


def prepared(accelerator: Any) -> tuple[list, list]:
    """(models, optimizers) the accelerator prepared, in preparation order."""
    models = lookup(accelerator, "_models", "accelerate", accelerate.__version__, TESTED)
    optimizers = lookup(accelerator, "_optimizers", "accelerate", accelerate.__version__, TESTED)
    return models, optimizers


def set_prepared(accelerator: Any, models: list, optimizers: list) -> None:
    prepared(accelerator)  # the same checks
    accelerator._models, accelerator._optimizers = models, optimizers
