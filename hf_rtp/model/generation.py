"""generate() on a rotated model: every forward walks the ring, so every rank must keep stepping.

transformers stops a rank's loop when its own sequences are done, which would leave the others
waiting in the ring. With `synced_gpus=True` finished ranks keep running forward passes until all
ranks are done (as under DeepSpeed ZeRO-3 or FSDP). hf_rtp makes that the default at world size > 1.
"""

from __future__ import annotations

from .context import refuse_inside
from .state import state_of


def generate(model, *args, synced_gpus: bool | None = None, **kwargs):
    refuse_inside(model, "generate()")
    topology = state_of(model).topology
    topology.enter("generate")
    if synced_gpus is None:
        synced_gpus = topology.world_size > 1
    return type(model).generate(model, *args, synced_gpus=synced_gpus, **kwargs)
