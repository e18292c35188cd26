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


def forget_prepared(model: Any) -> None:
    """Clear the mark accelerate's `prepare_model` leaves on a model (`_is_accelerate_prepared`), also after an
    evaluation-mode prepare that wrapped nothing: marked, a later prepare for training returns it unwrapped."""
    if "_is_accelerate_prepared" in model.__dict__:
        lookup(model, "_is_accelerate_prepared", "accelerate", accelerate.__version__, TESTED)
        del model.__dict__["_is_accelerate_prepared"]


def on_the_ring(config: Any) -> Any:
    """A copy of accelerate's ParallelismConfig `config` that accelerate accepts on MULTI_CPU too, for
    hf_rtp.Accelerator only: context parallelism on a rotated model runs on hf_rtp's ring, which needs no
    FSDP2 and no CUDA kernel; accelerate 1.15's `_validate_accelerator` refuses every config there."""
    from dataclasses import fields

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    validate = lookup(ParallelismConfig, "_validate_accelerator", "accelerate", accelerate.__version__, TESTED)

    class RingParallelismConfig(type(config)):  # type: ignore[misc]  # the user's class, whatever it is
        def _validate_accelerator(self, accelerator):
            if accelerator.distributed_type == DistributedType.MULTI_CPU:
                if self.total_size != accelerator.num_processes:
                    raise ValueError(
                        f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                        f"({accelerator.num_processes})"
                    )
                return None
            return validate(self, accelerator)

    RingParallelismConfig.__name__ = RingParallelismConfig.__qualname__ = type(config).__name__
    return RingParallelismConfig(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})


def prepare_context_parallel(accelerator: Any, args: tuple) -> tuple:
    """accelerate's own `_prepare_cp` (torch's context_parallel: hooks on each model, its rotate method)."""
    prepare = lookup(accelerate.Accelerator, "_prepare_cp", "accelerate", accelerate.__version__, TESTED)
    return prepare(accelerator, *args)
