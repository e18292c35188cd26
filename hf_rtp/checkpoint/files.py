"""Find a checkpoint's config and safetensors files, locally or in the Hub cache."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch.distributed as dist

from ..mesh import raise_if_any_failed

from ..errors import CheckpointError
from .safetensors_io import TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
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
            for name, filename in _read_index(index).items():
                if name not in entries or os.path.basename(entries[name].path) != filename:
                    raise CheckpointError(f"{index} lists {name} in {filename}, but that file does not hold it")
        return entries


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            return json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is not a valid safetensors index ({err}); download or save it again") from None


def find_weights(directory: str) -> CheckpointFiles:
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
        names = sorted(set(_read_index(index).values()))
        missing = [n for n in names if not os.path.exists(os.path.join(directory, n))]
        if missing:
            raise CheckpointError(f"{index} refers to missing file(s) {', '.join(missing)}: the download is incomplete")
        return CheckpointFiles(directory, tuple(os.path.join(directory, n) for n in names))
    single = os.path.join(directory, SINGLE_NAME)
    if os.path.exists(single):
        return CheckpointFiles(directory, (single,))
    pickles = sorted(os.path.basename(p) for pattern in _PICKLE_PATTERNS for p in glob.glob(os.path.join(directory, pattern)))
    if pickles:
        raise CheckpointError(
            f"{directory} holds only pickle weights ({', '.join(pickles)}). hf_rtp loads safetensors only: "
            "unpickling a file can run arbitrary code. Convert it once where you trust the file, e.g. "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(path)`, which writes model.safetensors."
        )
    raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {directory}")


def resolve_directory(name_or_path: str, revision=None, token=None, cache_dir=None, local_files_only=False, group=None) -> str:
    """A local directory as is; a Hub id downloaded by rank 0 first, then read from the cache by all."""
    if os.path.isdir(name_or_path):
        if not os.path.exists(os.path.join(name_or_path, "config.json")):
            raise CheckpointError(f"{name_or_path} has no config.json; is it a transformers checkpoint directory?")
        return name_or_path
    from huggingface_hub import snapshot_download

    def download(only_cached: bool) -> str:
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
            raise CheckpointError(
                f"'{name_or_path}' is not a local directory and could not be fetched from the Hub ({type(err).__name__}: "
                f"{err}). Check the path or repo id, your network or HF_HUB_OFFLINE, and your token."
            ) from err

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    path, error = None, None
    if rank0:
        try:
            path = download(local_files_only)
        except CheckpointError as err:
            error = err
    raise_if_any_failed(error, group, CheckpointError)  # the others then read what rank 0 cached
    return path if rank0 else download(True)
