"""Resumable training state: model chunks and optimizer state through torch.distributed.checkpoint,
written as safetensors (one file per rank, no pickle), plus a JSON file for everything else.

Loading reshards: a checkpoint saved by N ranks loads on M, because DCP records each chunk's place
in the global tensor and every rank reads the rows it now owns. A save is atomic (see
save_training_state) and a load verifies before it trusts (see load_training_state).
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .. import faults
from ..distributed.agreement import agreed
from ..errors import CheckpointError, HfRtpError, KeywordError
from ..folders.atomic import recover_folder, replace_folder
from ..folders.ownership import FolderLock, is_real_dir, read_json, write_json
from ..model.state import state_of
from .safetensors_io import read_header

STATE_FILE = "training_state.json"
MARKER = ".hf_rtp-state.json"  # written first into `<dir>.partial`: the folder is this save's own
_FORMAT = 2  # 2: `extra` under its own key; 1 (older): `extra` merged into hf_rtp's records
# 8-bit optimizer state's block scales (distributed/blockwise.py): bitsandbytes' and torchao's
_BLOCK_SCALES = re.compile(r"^optim\..*\.((absmax|qmap)[12]|(exp_avg|exp_avg_sq|max_exp_avg_sq)_scale)$")
_DCP_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer):
    """The state dicts DCP fills in place, and their tensors under flat names (the writer wants tensors)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # creates optimizer state with the right layout
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    states: Any = optim_sd["state"]  # {fqn: {key: value}}; DCP's annotation covers every state dict shape
    shared: set[int] = set()
    for fqn, state in sorted(states.items()):
        for key, value in _leaves(state):
            if isinstance(value, torch.Tensor) and id(value) not in shared:
                # one tensor several parameters' state holds (bitsandbytes' 8-bit code maps, `qmap1`) is written
                # once, under its first name, and read back into the one tensor they all share
                shared.add(id(value))
                flat[f"optim.{fqn}.{key}"] = value
    return model_sd, optim_sd, flat


def _leaves(state: dict, prefix: str = ""):
    """(dotted key, value) of a parameter's optimizer state, nested dicts walked: bitsandbytes' optimizers put
    their 8-bit state and its scales under `__bnb_optimizer_quant_state__`, which must be saved like the rest."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _scalars(optim_sd) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state that is not a tensor (bitsandbytes keeps `step` as an int), which DCP does
    not write: kept in training_state.json instead, or a resume would restart the optimizer's step count."""
    kept: dict[str, dict[str, Any]] = {}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) or (
                isinstance(value, dict) and all(isinstance(v, torch.Tensor) for _, v in _leaves(value))
            ):
                continue
            if not isinstance(value, (int, float, bool, str, type(None))):
                raise CheckpointError(
                    f"optimizer state {fqn}.{key} is a {type(value).__name__}, which hf_rtp cannot save: only "
                    "tensors (also in dicts) and numbers"
                )
            kept.setdefault(fqn, {})[key] = value
    return kept


_TENSOR = "__hf_rtp_tensor__"  # a tensor among the optimizer's groups or the scheduler's state, restored as one


def _to_json(value: Any) -> Any:
    """Param groups and scheduler state for training_state.json. torchao keeps `lr` as a 0-dim tensor (and refuses
    to step with a float in its place), and a scheduler then records its learning rates as tensors too: each
    tensor is kept as its values and dtype, which _from_json turns back into that tensor."""
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{STATE_FILE} records a tensor of dtype {value.get('dtype')!r}: it is damaged")
            return torch.tensor(value[_TENSOR], dtype=dtype)
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _identity(model: nn.Module) -> dict:
    state = state_of(model, required=False)
    return {"class": type(model).__name__, "plan": state.plan.name if state is not None else None}


def save_training_state(directory: str, model: nn.Module, optimizer, scheduler=None, extra: dict | None = None) -> None:
    """Collective. Write model, optimizer, scheduler, RNG and `extra` (step, data position) to `directory`.

    `directory` must be absent, empty, or a training state hf_rtp saved: a folder holding anything
    else, a file or a link is refused untouched. Every rank writes its chunks into
    `<directory>.partial`; rank 0 then records what was written (each file and its size, the model
    class and plan) in training_state.json, last, and swaps the folder in atomically (see atomic.py).
    A crash at any point leaves the previous checkpoint loadable. `extra` must be JSON: it is kept
    apart from hf_rtp's own records, and load_training_state returns it as it was given.
    """
    directory = _normalised(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial, group = f"{directory}.partial", _control(model)
    lock = None
    try:
        with agreed(group, CheckpointError):
            if rank == 0:
                _check_extra(extra)
                os.makedirs(os.path.dirname(directory), exist_ok=True)
                lock = FolderLock(directory + ".lock", directory).acquire()
                _check_target(directory)
                recover_folder(directory, _is_complete, _own_names, clean=True)
                if os.path.lexists(partial):
                    raise CheckpointError(
                        f"{partial} is in the way of this save and was not written by hf_rtp: move it away"
                    )
                os.mkdir(partial)
                write_json(os.path.join(partial, MARKER), {"hf_rtp_state": True})
        _, optim_sd, flat = _tensors(model, optimizer)
        writer = dcp.HuggingFaceStorageWriter(partial, save_distributed=True)
        with _named_waits("save_training_state", directory):
            dcp.save(flat, storage_writer=writer, process_group=group)  # hf_rtp's timeout, not the world's
            faults.point("state.write")
            rng = _gather_rng(group)
        with agreed(group, CheckpointError):
            if rank == 0:
                files = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
                state = {
                    "format": _FORMAT,
                    "identity": _identity(model),
                    "files": files,
                    "param_groups": _to_json(optim_sd["param_groups"]),
                    "scalars": _scalars(optim_sd),
                    "scheduler": _to_json(scheduler.state_dict()) if scheduler is not None else None,
                    "rng": rng,
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "extra": dict(extra or {}),
                }
                _write_json(os.path.join(partial, STATE_FILE), state)
                replace_folder(partial, directory, _own_names)
    finally:
        if lock is not None:
            lock.release()


def load_training_state(directory: str, model: nn.Module, optimizer, scheduler=None) -> dict:
    """Collective. Restore what save_training_state wrote, at this world size; returns its `extra`.

    Nothing is loaded until every rank has verified the checkpoint: its files are all there, whole
    and as written, it covers every parameter and optimizer tensor of this model and optimizer, and
    it was saved from the same model class and plan. Otherwise every rank raises a CheckpointError
    naming what is wrong, and the model and optimizer are untouched.
    """
    directory = _normalised(directory)
    group, rank = _control(model), dist.get_rank() if dist.is_initialized() else 0
    with agreed(group, CheckpointError):
        # a swap a crash interrupted: put the newer complete folder in place (nothing else is touched)
        if (
            rank == 0
            and not os.path.lexists(directory)
            and any(os.path.lexists(directory + s) for s in (".partial", ".old"))
        ):
            with FolderLock(directory + ".lock", directory):
                recover_folder(directory, _is_complete, _own_names, clean=False)
    model_sd, optim_sd, flat = _tensors(model, optimizer)
    with agreed(group, CheckpointError):
        state = _read_state(directory)
        _verify(directory, state, flat, model, optim_sd)
        groups, scheduled = _from_json(state["param_groups"]), _from_json(state.get("scheduler"))
    with _named_waits("load_training_state", directory):
        dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(directory), process_group=group)
        optim_sd["param_groups"] = groups
        for fqn, kept in state.get("scalars", {}).items():  # absent from checkpoints saved before it was kept
            optim_sd["state"].setdefault(fqn, {}).update(kept)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        _keep_loaded_dtypes(model, optimizer, optim_sd)
        if scheduler is not None and scheduled is not None:
            scheduler.load_state_dict(scheduled)
    rng = state["rng"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.get("world_size") == world:  # at another world size the old per-rank streams mean nothing
        torch.set_rng_state(torch.tensor(rng[rank]["cpu"], dtype=torch.uint8))
        if torch.cuda.is_available() and rng[rank].get("cuda") is not None:
            torch.cuda.set_rng_state(torch.tensor(rng[rank]["cuda"], dtype=torch.uint8))
    return _extra(state)


def _keep_loaded_dtypes(model: nn.Module, optimizer, optim_sd: dict) -> None:
    """torch's Optimizer.load_state_dict casts every state tensor but `step` to its parameter's dtype: right for
    moments, wrong for 8-bit codes and their float32 scales (torchao's on rotated rows, integrations/torchao.py,
    which keeps them as plain tensors). Those are put back as DCP read them, in the dtype this optimizer keeps."""
    params = dict(model.named_parameters())
    for fqn, loaded in optim_sd["state"].items():
        state = optimizer.state.get(params[fqn], {}) if fqn in params else {}
        for key, value in loaded.items():
            kept = state.get(key)
            if isinstance(value, torch.Tensor) and isinstance(kept, torch.Tensor) and kept.dtype != value.dtype:
                state[key] = value


_RECORDS = ("format", "identity", "files", "param_groups", "scalars", "scheduler", "rng", "world_size", "extra")


def _extra(state: dict) -> dict:
    if state.get("format", 1) >= 2:
        return dict(state.get("extra") or {})
    return {k: v for k, v in state.items() if k not in _RECORDS}  # format 1 merged `extra` into the records


def _check_extra(extra) -> None:
    if extra is None:
        return
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise KeywordError(f"extra must be a dict with string keys, got {type(extra).__name__}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise KeywordError(f"extra must hold only JSON values (numbers, strings, lists, dicts): {err}") from None


def _normalised(directory) -> str:
    """One spelling per folder: `~`, relative paths and trailing slashes would otherwise name siblings
    such as `ckpt/.partial` instead of `ckpt.partial`."""
    path = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.basename(path) in ("", ".", ".."):
        raise CheckpointError(f"{directory!r} cannot hold a training state: name a folder")
    return path


def _check_target(directory: str) -> None:
    """The target is absent, empty or a training state of hf_rtp's own; anything else is refused untouched."""
    if not os.path.lexists(directory):
        return
    if os.path.islink(directory) or not os.path.isdir(directory):
        kind = "a symbolic link" if os.path.islink(directory) else "a file"
        raise CheckpointError(f"{directory} is {kind}, not a folder: pass a folder path for the training state")
    if _own_names(directory) is None:
        foreign = sorted(n for n in os.listdir(directory) if not _own_name(n))
        what = f"holds {', '.join(foreign[:5])}" if foreign else f"has no {STATE_FILE} of hf_rtp's"
        raise CheckpointError(
            f"{directory} exists and {what}, which hf_rtp did not write; saving a training state there would "
            "replace the whole folder. Pass a new or empty folder (for example a checkpoint-<step> subfolder)"
        )


def _own_name(name: str) -> bool:
    return name in (STATE_FILE, MARKER) or bool(_DCP_SHARD.fullmatch(name))


def _own_names(folder: str) -> list[str] | None:
    """Every name in `folder` when it is provably a training state hf_rtp wrote (complete, or a partial
    one that carries its marker), or an empty folder; None otherwise."""
    if not is_real_dir(folder):
        return None
    names = sorted(os.listdir(folder))
    if not names:
        return names
    if not all(_own_name(n) for n in names):
        return None
    try:
        if MARKER in names and read_json(os.path.join(folder, MARKER), "marker", 4096, follow_links=False) == {
            "hf_rtp_state": True
        }:
            return names
        state = read_json(os.path.join(folder, STATE_FILE), "training state", follow_links=False)
    except CheckpointError:
        return None
    files = state.get("files") if isinstance(state, dict) else None
    if isinstance(state, dict) and state.get("format") in (1, _FORMAT) and (files is None or isinstance(files, dict)):
        return names if files is None or set(names) <= set(files) | {STATE_FILE} else None
    return None


def _read_state(directory: str) -> dict:
    path = os.path.join(directory, STATE_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{directory} is not a complete training checkpoint (no {STATE_FILE}); a save may have been interrupted: "
            "resume from an earlier checkpoint-* folder"
        )
    try:
        state = read_json(path, "training state")
        missing = sorted({"param_groups", "rng", "world_size"} - set(state)) if isinstance(state, dict) else ["all"]
        if missing:
            raise CheckpointError(f"it lacks {', '.join(missing)}")
        if not isinstance(state["param_groups"], list) or not isinstance(state["rng"], list):
            raise CheckpointError("param_groups or rng is not a list")
        if not all(isinstance(r, dict) and isinstance(r.get("cpu"), list) for r in state["rng"]):
            raise CheckpointError("an RNG state is malformed")
        if not isinstance(state.get("extra", {}), dict) or not isinstance(state.get("files", {}), dict):
            raise CheckpointError("extra or files is not an object")
    except CheckpointError as err:
        raise CheckpointError(
            f"{path} is damaged ({err}); this checkpoint cannot be trusted: resume from an earlier checkpoint-* folder"
        ) from None
    return state


def _is_complete(folder: str) -> bool:
    try:
        _check_files(folder, _read_state(folder))
        return True
    except CheckpointError:
        return False


def _check_files(directory: str, state: dict) -> None:
    """Every file the save recorded is there with the size it was written with, and nothing else."""
    files = state.get("files")
    if files is None:
        return  # written before hf_rtp recorded files: the coverage check still holds
    present = {f for f in os.listdir(directory) if f != STATE_FILE}
    missing, extra = sorted(set(files) - present), sorted(present - set(files))
    if missing:
        raise CheckpointError(
            f"{directory} is incomplete: {', '.join(missing)} missing. Every rank's file is needed to resume; "
            "copy the whole folder again, or resume from an earlier checkpoint-* folder"
        )
    if extra:
        raise CheckpointError(
            f"{directory} holds file(s) its save did not write ({', '.join(extra)}); they would be read as part of "
            "the checkpoint. Remove them, or resume from an earlier checkpoint-* folder"
        )
    for name, size in files.items():
        path = os.path.join(directory, name)
        if os.path.getsize(path) != size:
            raise CheckpointError(
                f"{path} has {os.path.getsize(path)} bytes but was saved with {size}: it is truncated or was "
                "overwritten. Copy the folder again, or resume from an earlier checkpoint-* folder"
            )
        if name.endswith(".safetensors"):
            read_header(path)


def _verify(directory: str, state: dict, flat: dict, model: nn.Module, optim_sd: dict) -> None:
    _check_files(directory, state)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.get("world_size") == world and len(state["rng"]) != world:
        raise CheckpointError(f"{directory}/{STATE_FILE} records {len(state['rng'])} RNG states for {world} ranks")
    saved_groups = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in state["param_groups"]]
    groups = [len(g["params"]) for g in optim_sd["param_groups"]]
    if saved_groups != groups:
        raise CheckpointError(
            f"{directory} was saved from an optimizer whose parameter groups hold {saved_groups} parameters, but this "
            f"optimizer's hold {groups}: build the optimizer as the run that saved it did"
        )
    saved_as = state.get("identity")
    if saved_as is not None and saved_as != _identity(model):
        raise CheckpointError(
            f"{directory} was saved from a {saved_as['class']} with plan '{saved_as['plan']}', but this model is a "
            f"{_identity(model)['class']} with plan '{_identity(model)['plan']}': load the model (and plan) it was "
            "saved from"
        )
    try:
        stored = dcp.HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"cannot read the tensors of {directory} ({type(err).__name__}: {err})") from err
    missing = sorted(set(flat) - set(stored))
    unknown = sorted(set(stored) - set(flat))
    if any(_BLOCK_SCALES.search(k) for k in missing + unknown):
        raise CheckpointError(
            f"{directory} holds 8-bit optimizer state (bitsandbytes' or torchao's) in another form than this run "
            "keeps it: "
            + (f"it lacks {_listing(missing)}" if missing else f"it holds {_listing(unknown)}")
            + ". hf_rtp keeps a parameter's 8-bit state only where every rank's rows start on one of the optimizer's "
            "blocks (256 elements), unquantized state elsewhere, and that depends on the world size: resume at the "
            f"world size it was saved at ({state.get('world_size')}), or at one where the same parameters align (or it "
            "was saved with another optimizer class or optim_bits: resume with the one it was saved with)"
        )
    if missing or unknown:
        raise CheckpointError(
            f"{directory} does not match this model and optimizer: "
            + (f"it lacks {_listing(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"it holds {_listing(unknown)}, which they do not have" if unknown else "")
            + ". A file of the checkpoint is missing, or it was saved from another model, plan or optimizer class: "
            "copy the whole folder again, resume with what it was saved with, or from an earlier checkpoint-* folder"
        )
    for key, tensor in flat.items():
        meta, shape = stored[key], tuple(tensor.shape)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{directory} stores {key} as bytes, not as a tensor: it belongs to another model")
        covered = sum(math.prod(c.sizes) for c in {(tuple(c.offsets), tuple(c.sizes)): c for c in meta.chunks}.values())
        # DCP would cast into it: bitsandbytes' uint8 codes read as float32 moments
        if meta.properties.dtype.is_floating_point != tensor.dtype.is_floating_point:
            raise CheckpointError(
                f"{directory} stores {key} as {meta.properties.dtype}, but this optimizer keeps it as {tensor.dtype}: "
                "it was saved with other optimizer settings (optim_bits, or another world size where bitsandbytes' "
                "blocks align differently). Resume with the settings and world size it was saved with"
            )
        if tuple(meta.size) != shape or covered != math.prod(shape):
            raise CheckpointError(
                f"{directory} holds {covered} of the {math.prod(shape)} elements of {key} (shape {list(meta.size)}, "
                f"the model has {list(shape)}): a shard is missing or belongs to another model. Resume from an "
                "earlier checkpoint-* folder"
            )


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def _named_waits(call: str, directory: str):
    """A wait that times out inside DCP surfaces as gloo's or DCP's own words; say what it means."""
    try:
        yield
    except HfRtpError:
        raise
    except CheckpointException as err:  # DCP's, a BaseException: each failed rank's error, gathered by DCP
        failures = "; ".join(
            f"rank {r}: {type(e[0]).__name__}: {str(e[0])[:300]}" for r, e in sorted(err.failures.items())
        )
        raise CheckpointError(
            f"{call}({directory}) failed in torch.distributed.checkpoint on {failures}. The previous checkpoint, if "
            "any, is untouched"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{call}({directory}) failed on this rank: {type(err).__name__}: {str(err)[:500]}. If a timeout is "
            "named, another rank stopped, died or did not call it within HF_RTP_TIMEOUT: every rank must call "
            f"{call}. The previous checkpoint, if any, is untouched"
        ) from err


def _gather_rng(group) -> list[dict]:
    mine = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state().tolist()
    if not dist.is_initialized():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _control(model: nn.Module):
    """hf_rtp's gloo group with hf_rtp's timeout, whoever made the world group."""
    state = state_of(model, required=False)
    return None if state is None else state.topology.control
