"""generate() on a rotated model: every forward walks the ring, so every rank must keep stepping.

transformers stops a rank's loop when its own sequences are done, which would leave the others
waiting in the ring. With `synced_gpus=True` finished ranks keep running forward passes until all
ranks are done (as under DeepSpeed ZeRO-3 or FSDP). hf_rtp makes that the default at world size > 1.

Ranks step together, so they must decode with the same settings: ranks that pass generate different
generation settings (max_new_tokens, sampling, beams, ...) fail at once, every rank naming the difference.
Each rank's inputs are its own.
"""

from __future__ import annotations

import copy
import re

from transformers import GenerationConfig

from . import traffic
from .context import refuse_inside
from .state import state_of

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's repr differs per process: compared by its type only


def settings_of(model, args: tuple, kwargs: dict, synced_gpus: bool) -> dict[str, str]:
    """The generation settings this call decodes with, as transformers merges them (the model's or the passed
    generation_config, updated by the keywords it knows), by name, as text every rank can compare."""
    given = kwargs.get("generation_config")
    if given is None and len(args) > 1 and isinstance(args[1], GenerationConfig):
        given = args[1]
    config = copy.deepcopy(given if given is not None else model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    settings = {name: _ADDRESS.sub("", repr(value)) for name, value in config.to_dict().items()}
    settings["synced_gpus"] = repr(synced_gpus)
    return settings


def generate(model, *args, synced_gpus: bool | None = None, **kwargs):
    refuse_inside(model, "generate()")
    topology = state_of(model).topology
    topology.enter("generate")
    if synced_gpus is None:
        synced_gpus = topology.world_size > 1
    topology.same_settings("generate", settings_of(model, args, kwargs, synced_gpus))
    try:
        return type(model).generate(model, *args, synced_gpus=synced_gpus, **kwargs)
    finally:
        traffic.clear(topology.ring)
