"""What each rank loaded, as a few short values every rank compares before any rank trains.

Ranks that read different checkpoints of the same shapes (two folders, two Hub caches holding
different revisions) would otherwise train one mixed model without a single error, and ranks with
other shapes, plans or piece sizes would fail only at the first forward, deep inside the ring.
Each rank reads only its own rows, so the weights are compared through bytes every rank reads
alike: each file's header and a few evenly spaced blocks of its data (16 x 4 KB per file).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .safetensors_io import TensorEntry

SAMPLES, BLOCK = 16, 4096


def _digest(data: bytes) -> str:
    return "#" + hashlib.sha256(data).hexdigest()[:12]


def _sampled_bytes(paths: list[str]) -> str:
    hasher = hashlib.sha256()
    for path in paths:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            hasher.update(size.to_bytes(8, "little") + f.read(header_len))
            start, length = 8 + header_len, size - 8 - header_len
            for i in range(SAMPLES if length > 0 else 0):
                f.seek(start + (length - min(BLOCK, length)) * i // max(SAMPLES - 1, 1))
                hasher.update(f.read(BLOCK))
    return "#" + hasher.hexdigest()[:12]


def fingerprint(*, commit, config, entries: dict[str, TensorEntry], plan, piece_bytes, dtype) -> dict[str, str]:
    """`plan` as given to from_pretrained: a Plan (its rules count) or a name ("auto", a model_type)."""
    import transformers

    from .. import __version__

    settings = json.loads(config.to_json_string(use_diff=False))
    settings.pop("_name_or_path", None)  # a byte-identical copy in another folder is the same checkpoint
    return {
        "library versions (hf_rtp, transformers, torch)": f"{__version__}, {transformers.__version__}, {torch.__version__}",
        "revision": commit or "a local folder",
        "config": _digest(json.dumps(settings, sort_keys=True).encode()),
        "tensor names, shapes and dtypes": _digest(
            json.dumps(sorted((n, str(e.dtype), list(e.shape)) for n, e in entries.items())).encode()
        ),
        "weight bytes (headers and sampled data)": _sampled_bytes(sorted({e.path for e in entries.values()})),
        "plan": plan if isinstance(plan, str) else f"{plan.name} " + _digest(
            json.dumps([sorted(plan.rotate.items()), list(plan.replicate)]).encode()
        ),
        "rotation_piece_size": f"{piece_bytes} bytes",
        "dtype": str(dtype),
    }


def agree(mine: dict[str, str], group) -> None:
    """Collective (one all_gather of a few strings). Raise on every rank when any rank differs."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    differences = []
    for rank, theirs in enumerate(everyone):
        keys = [k for k in reference if theirs.get(k) != reference[k]]
        if keys:
            differences.append(
                f"rank {rank} differs from rank 0 in "
                + ", ".join(f"{k} ({theirs.get(k)} vs {reference[k]})" for k in keys)
            )
    if differences:
        raise CheckpointError(
            "ranks loaded different models, which trained together would silently mix: "
            + "; ".join(differences)
            + ". Every rank must load the same checkpoint with the same settings: one folder (or byte-identical "
            "copies), one revision (pass revision= a commit hash), and the same plan, dtype, rotation_piece_size "
            "and library versions."
        )
