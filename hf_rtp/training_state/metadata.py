"""training_state.json: the record of a training state, typed and versioned.

Everything that is not a tensor DCP writes is here: what the save wrote (each file and its size), the
model it was saved from, the optimizer's groups and its state that is not a tensor, the scheduler's state,
each rank's RNG state and the user's `extra`. Reading it checks each field's type before anything uses it,
and refuses a format this hf_rtp does not know by its number.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import CheckpointError
from ..folders.ownership import read_json
from ..model.state import state_of
from ..version import __version__

STATE_FILE = "training_state.json"
# The formats of training_state.json; every one listed is still read:
# 1: the first; the user's `extra` merged among hf_rtp's own keys (read back as every key that is not one
#    of hf_rtp's). `format`, `identity`, `files` and `scalars` may be absent: each came later.
# 2: `extra` under a key of its own, so a key of the user's cannot shadow one of hf_rtp's.
FORMAT = 2
FORMATS = (1, 2)
_RECORDS = ("format", "identity", "files", "param_groups", "scalars", "scheduler", "rng", "world_size", "extra")


@dataclass(frozen=True)
class Identity:
    """The model a state was saved from: its class and its plan's name (None: not rotated)."""

    model_class: str
    plan: str | None

    @classmethod
    def of(cls, model: nn.Module) -> Identity:
        state = state_of(model, required=False)
        return cls(type(model).__name__, state.plan.name if state is not None else None)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.model_class, "plan": self.plan}

    @classmethod
    def from_json(cls, value: Any) -> Identity:
        if not isinstance(value, dict) or not isinstance(value.get("class"), str):
            raise CheckpointError("identity is not an object with a class name")
        if not isinstance(value.get("plan"), (str, type(None))):
            raise CheckpointError("identity's plan is not a name")
        return cls(value["class"], value["plan"])


@dataclass(frozen=True)
class TrainingStateMetadata:
    """The contents of training_state.json. `param_groups` and `scheduler` are as JSON holds them, tensors
    encoded (training_state/tensor_json.py): the load decodes them inside the ranks' agreement."""

    param_groups: list[dict[str, Any]]  # the optimizer's groups, `params` naming each parameter
    rng: list[dict[str, Any]]  # per rank of the save: {"cpu": the CPU generator's bytes, "cuda": ... or absent}
    world_size: int
    identity: Identity | None = None  # None: saved before hf_rtp recorded it
    files: dict[str, int] | None = None  # each file the save wrote and its size; None: saved before it did
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)  # optimizer state that is not a tensor
    scheduler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the user's, returned as given

    def to_json(self) -> dict[str, Any]:
        """The record in the current FORMAT, its keys in the order hf_rtp has always written them."""
        data: dict[str, Any] = {
            "format": FORMAT,
            "identity": self.identity.to_json() if self.identity is not None else None,
            "files": self.files,
            "param_groups": self.param_groups,
            "scalars": self.scalars,
            "scheduler": self.scheduler,
            "rng": self.rng,
            "world_size": self.world_size,
            "extra": self.extra,
        }
        if self.files is None:
            del data["files"]  # absent, as in the checkpoints that lacked it (null would read as damaged)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = STATE_FILE) -> TrainingStateMetadata:
        """The record `data` (json.load's) holds, each field's type checked; CheckpointError naming what is wrong,
        or the format when it is one this hf_rtp does not read."""
        version = data.get("format", 1) if isinstance(data, dict) else 1
        if isinstance(version, int) and not isinstance(version, bool) and version not in FORMATS:
            raise CheckpointError(
                f"{where} is in format {version}, which hf_rtp {__version__} does not read (it reads formats "
                f"{', '.join(map(str, FORMATS))}): it was saved by a newer hf_rtp. Resume with that version, or "
                "from an earlier checkpoint-* folder"
            )
        try:
            return cls._checked(data, version)
        except CheckpointError as err:
            raise CheckpointError(damaged(where, err)) from None

    @classmethod
    def _checked(cls, state: Any, version: Any) -> TrainingStateMetadata:
        missing = sorted({"param_groups", "rng", "world_size"} - set(state)) if isinstance(state, dict) else ["all"]
        if missing:
            raise CheckpointError(f"it lacks {', '.join(missing)}")
        if not isinstance(state["param_groups"], list) or not isinstance(state["rng"], list):
            raise CheckpointError("param_groups or rng is not a list")
        if not all(isinstance(r, dict) and isinstance(r.get("cpu"), list) for r in state["rng"]):
            raise CheckpointError("an RNG state is malformed")
        if not isinstance(state.get("extra", {}), dict) or not isinstance(state.get("files", {}), dict):
            raise CheckpointError("extra or files is not an object")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CheckpointError(f"format is {version!r}, not a number")
        if not all(isinstance(g, dict) for g in state["param_groups"]):
            raise CheckpointError("a param group is not an object")
        if not _whole(state["world_size"]):
            raise CheckpointError(f"world_size is {state['world_size']!r}, not a whole number")
        files = state.get("files")
        if files is not None and not all(_whole(size) for size in files.values()):
            raise CheckpointError("a file's size in files is not a whole number")
        scalars = state.get("scalars", {})
        if not isinstance(scalars, dict) or not all(isinstance(s, dict) for s in scalars.values()):
            raise CheckpointError("scalars is not an object of objects")
        if not isinstance(state.get("scheduler"), (dict, type(None))):
            raise CheckpointError("scheduler is not an object")
        identity = state.get("identity")
        return cls(
            param_groups=state["param_groups"],
            rng=state["rng"],
            world_size=state["world_size"],
            identity=Identity.from_json(identity) if identity is not None else None,
            files=files,
            scalars=scalars,
            scheduler=state.get("scheduler"),
            extra=_extra(state, version),
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _extra(state: dict, version: int) -> dict:
    if version >= 2:
        return dict(state.get("extra") or {})
    return {k: v for k, v in state.items() if k not in _RECORDS}  # format 1 merged `extra` into the records


def damaged(where: str, err: Exception) -> str:
    return f"{where} is damaged ({err}); this checkpoint cannot be trusted: resume from an earlier checkpoint-* folder"


def read_state(directory: str) -> TrainingStateMetadata:
    path = os.path.join(directory, STATE_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{directory} is not a complete training checkpoint (no {STATE_FILE}); a save may have been interrupted: "
            "resume from an earlier checkpoint-* folder"
        )
    try:
        state = read_json(path, "training state")
    except CheckpointError as err:
        raise CheckpointError(damaged(path, err)) from None
    return TrainingStateMetadata.from_json(state, path)


def write_state(folder: str, metadata: TrainingStateMetadata) -> None:
    """training_state.json into `folder`, on disk (fsync'd) before the folder is swapped in."""
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump(metadata.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
