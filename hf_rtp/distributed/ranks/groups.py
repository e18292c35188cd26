"""hf_rtp's own process groups: made once per role and set of ranks, torn down before the world's.

hf_rtp never communicates on the world group: whoever made that (accelerate and Trainer give it
30 minutes), every collective hf_rtp issues runs on a group of its own carrying hf_rtp's timeout.
A world group hf_rtp made itself (from_pretrained under torchrun, before anyone else did) is hf_rtp's to
tear down too: at exit, after its own groups, unless the script destroyed it already.
"""

from __future__ import annotations

import atexit
import contextlib
from datetime import timedelta

import torch.distributed as dist

_groups: dict[tuple, dist.ProcessGroup] = {}
_groups_world: list = []  # the world group every entry of _groups was made in (the object itself: see group)
_world: list = []  # the world group hf_rtp initialised, if it did
_registered: list = []  # the exit handler, once per process


def init_world(**kwargs) -> None:
    """dist.init_process_group(**kwargs), remembered as hf_rtp's to destroy at exit."""
    dist.init_process_group(**kwargs)
    _world[:] = [dist.group.WORLD]
    _at_exit()


def group(role: str, ranks: tuple, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """The group of `ranks` for `role`, made on first use (new_group is collective over the world:
    every rank must ask for every group in one order).

    The groups belong to the world they were made in: a world destroyed and made again gets its own. That is told by
    the world object itself, held here, never by its id(): a new world can be given a destroyed one's address."""
    world = dist.group.WORLD
    if not _groups_world or _groups_world[0] is not world:
        _groups.clear()  # made in a world since destroyed, which destroyed them with it
        _groups_world[:] = [world]
    key = (role, ranks, backend, timeout)
    if key not in _groups:
        _at_exit()
        _groups[key] = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
    return _groups[key]


def _at_exit() -> None:
    if not _registered:
        atexit.register(_destroy_groups)
        _registered.append(True)


def _destroy_groups() -> None:
    """Tear hf_rtp's groups down while the world group still exists, then the world group if hf_rtp made it:
    left to interpreter shutdown, a gloo group can abort the process ("terminate called without an active
    exception") after the script's own work succeeded. No wait: destroying a group does not communicate."""
    if dist.is_initialized():
        if _groups_world and _groups_world[0] is dist.group.WORLD:  # not a destroyed world's, dead already
            for made in _groups.values():
                with contextlib.suppress(RuntimeError, ValueError):  # the user destroyed them already
                    dist.destroy_process_group(made)
        if _world and dist.group.WORLD is _world[0]:  # still the one hf_rtp made, not a later one of the user's
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()
    _groups.clear()
    _groups_world.clear()
    _world.clear()
