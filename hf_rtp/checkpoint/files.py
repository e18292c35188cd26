"""Find a checkpoint's config and safetensors files, locally or in the Hub cache."""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass

import torch.distributed as dist

from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError
from ..folders.commit import INDEX_NAME, JOURNAL, SINGLE_NAME
from ..folders.ownership import read_json
from .safetensors_io import TensorEntry, read_header

_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class CheckpointFiles:
    directory: str
    weight_files: tuple[str, ...]

    def tensors(self) -> dict[str, TensorEntry]:
        """Every tensor of the checkpoint by name, headers validated against file sizes."""
        entries: dict[str, TensorEntry] = {}
        for path in self.weight_files:
            entries.update(read_header(path))
        index = os.path.join(self.directory, INDEX_NAME)
        if os.path.exists(index):
            weight_map = _read_index(index)
            paths = {f: _inside(self.directory, f, index) for f in set(weight_map.values())}
            for name, filename in weight_map.items():
                if name not in entries or entries[name].path != paths[filename]:
                    raise CheckpointError(f"{index} lists {name} in {filename}, but that file does not hold it")
        return entries


def _read_index(path: str) -> dict[str, str]:
    try:
        weight_map = read_json(path, "safetensors index")["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        return weight_map
    except (CheckpointError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a valid safetensors index ({err}); download or save it again") from None


def _inside(directory: str, name, index: str) -> str:
    """The path of a file an index names, which must be a plain file name: one name, directly in the checkpoint
    folder (as vanilla writes an index), never a path.

    An index is data from the Hub: `../x`, `/etc/...`, `/dev/stdin` or `sub/x` would make a loader read (or
    block on) files elsewhere than the checkpoint's own; so any separator (`/`, or `\\` as Windows reads it),
    `.`, `..`, an empty name or a NUL byte is refused. Hub caches link files to blobs elsewhere, so the name is
    checked, and the file it reaches must be a regular file.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise CheckpointError(
            f"{index} names {name!r} as a weight file; an index may only name files inside its own folder, by a plain "
            "file name. The index is damaged or was made to read other files: download or save the checkpoint again"
        )
    path = os.path.join(directory, name)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise CheckpointError(f"{index} names {name!r}, which is not a regular file; refusing to read it")
    return path


def find_weights(directory: str, variant: str | None = None) -> CheckpointFiles:
    """The checkpoint's safetensors files: the index's, or the single file; with vanilla's `variant`,
    `model.safetensors.index.<variant>.json` or `model.<variant>.safetensors`."""
    index_name, single_name = (INDEX_NAME, SINGLE_NAME) if variant is None else _variant_names(variant)
    index = os.path.join(directory, index_name)
    if os.path.exists(index):
        paths = sorted({_inside(directory, n, index) for n in _read_index(index).values()})
        missing = [os.path.relpath(p, directory) for p in paths if not os.path.exists(p)]
        if missing:
            raise CheckpointError(f"{index} refers to missing file(s) {', '.join(missing)}: the download is incomplete")
        return CheckpointFiles(directory, tuple(paths))
    single = _inside(directory, single_name, directory)
    if os.path.exists(single):
        return CheckpointFiles(directory, (single,))
    pickles = sorted(
        os.path.basename(p) for pattern in _PICKLE_PATTERNS for p in glob.glob(os.path.join(directory, pattern))
    )
    if pickles:
        raise CheckpointError(
            f"{directory} holds only pickle weights ({', '.join(pickles)}). hf_rtp loads safetensors only: "
            "unpickling a file can run arbitrary code. Convert it once where you trust the file, e.g. "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(path)`, which writes model.safetensors."
        )
    raise CheckpointError(f"no {single_name} or {index_name} in {directory}")


def _variant_names(variant: str) -> tuple[str, str]:
    """transformers' `_add_variant`: the variant goes before the last suffix of each name."""
    if not variant or os.sep in variant or "/" in variant:
        raise ValueError(f"variant must be a plain name such as 'fp16', got {variant!r}")
    return f"model.safetensors.index.{variant}.json", f"model.{variant}.safetensors"


def resolve_directory(
    name_or_path: str, revision=None, token=None, cache_dir=None, local_files_only=False, group=None
) -> tuple[str, str | None]:
    """(folder to read, commit hash or None for a local folder). Collective.

    A local directory is used as is. A Hub id is resolved to one commit by global rank 0, which
    downloads it; then the first rank of every other node downloads that same commit into its own
    cache (nodes need not share one), and the remaining ranks read it from their node's cache. So
    every rank reads one revision, even when caches on different nodes hold different `main`s.
    """
    local = os.path.isdir(name_or_path)
    if dist.is_initialized():
        seen: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, local, group=group)
        if len(set(seen)) > 1:
            raise CheckpointError(
                f"'{name_or_path}' is a local folder on rank(s) {[r for r, x in enumerate(seen) if x]} but not on "
                f"rank(s) {[r for r, x in enumerate(seen) if not x]}; every rank must load the same checkpoint: put "
                "it on a filesystem every node sees, or load it by Hub id"
            )
    if local:
        if not os.path.lexists(os.path.join(name_or_path, JOURNAL)):
            require_config(name_or_path)
        # else a save a crash interrupted, maybe before it moved config.json in: the load's recovery step comes
        # next (loader.recover: it finishes the commit or says why not; resolving a path never does), then this check
        return name_or_path, None
    if not dist.is_initialized():
        downloaded = _download(name_or_path, revision, token, cache_dir, local_files_only)
        return downloaded, os.path.basename(downloaded)
    rank, node_first = dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    path: str | None = None
    commit: str | None = None
    with agreed(group, CheckpointError):
        if rank == 0:
            path = _download(name_or_path, revision, token, cache_dir, local_files_only)
            commit = os.path.basename(path)
    box = [commit]
    dist.broadcast_object_list(box, src=0, group=group)
    commit = box[0]
    with agreed(group, CheckpointError):
        if rank != 0 and node_first:  # one download per node, of the commit rank 0 chose
            path = _download(name_or_path, commit, token, cache_dir, local_files_only, chosen=True)
    with agreed(group, CheckpointError):
        if path is None:  # the node's first rank has it in this node's cache now
            path = _download(name_or_path, commit, token, cache_dir, True, chosen=True)
    return path, commit


def require_config(directory: str) -> None:
    """A local folder must hold config.json; else the error names what it holds instead."""
    if not os.path.exists(os.path.join(directory, "config.json")):
        if os.path.exists(os.path.join(directory, "adapter_config.json")):
            raise CheckpointError(
                f"{directory} holds a PEFT adapter only (adapter_config.json, no config.json). Vanilla "
                "from_pretrained would load its base and apply it; hf_rtp does not apply adapters at load: "
                "load the base model's folder, or merge the adapter with vanilla and load the merged folder"
            )
        raise CheckpointError(f"{directory} has no config.json; is it a transformers checkpoint directory?")


def _download(name_or_path, revision, token, cache_dir, only_cached, chosen=False) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=only_cached,
            allow_patterns=["*.json", "*.safetensors"],
        )
    except Exception as err:  # huggingface_hub has many error types; the fix is the same
        if chosen:
            raise CheckpointError(
                f"'{name_or_path}' at revision {revision} (the commit rank 0 resolved) is not in this rank's cache and "
                f"could not be fetched ({type(err).__name__}). Every rank must read the same revision: share the cache "
                "between nodes, allow downloads (unset HF_HUB_OFFLINE), or pass revision= a commit every cache holds."
            ) from err
        raise CheckpointError(
            f"'{name_or_path}' is not a local directory and could not be fetched from the Hub ({type(err).__name__}: "
            f"{err}). Check the path or repo id, your network or HF_HUB_OFFLINE, and your token."
        ) from err
