"""Ranks prove they load one and the same checkpoint: the same settings, and the same bytes.

Ranks that read different checkpoints of the same shapes (two folders, two Hub caches holding
different revisions, a copy damaged in a few KB) would otherwise train one mixed model without a
single error. Each rank reads only its own rows of rotated tensors, so the bytes are proven per file,
by the first of these that holds (`prove_files`, before anything is read):

- every rank opens the same file: inode, size and modification time (ns) agree (one folder on a
  shared filesystem; checked again after the read, so a file rewritten meanwhile is caught);
- every rank reads a Hub cache blob named by the same SHA-256, the hash the Hub recorded;
- the file carries hf_rtp's block digests (digests.py) and every rank verifies each block it reads
  against them; ranks compare headers, so those digests are the same everywhere;
- otherwise (copies of a vanilla checkpoint, one per node, say) one rank per copy hashes the whole
  file, spread over the ranks that share the copy, and the hashes must agree.

With verify_weights="full" every file is hashed whole by one rank per copy and checked against every
hash recorded for it (the Hub's, hf_rtp's blocks). Replicated tensors are read in full by every rank,
and their SHA-256s are compared after the read (`agree_on_read`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch
import torch.distributed as dist

from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError
from ..log import warning
from .safetensors_io import TensorEntry

_READ = 8 << 20


def _digest(data: bytes) -> str:
    return "#" + hashlib.sha256(data).hexdigest()[:12]


def _headers(paths: list[str]) -> str:
    hasher = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            hasher.update(os.path.getsize(path).to_bytes(8, "little") + f.read(header_len))
    return "#" + hasher.hexdigest()[:12]


def fingerprint(
    *,
    commit,
    config,
    entries: dict[str, TensorEntry],
    plan,
    piece_bytes,
    dtype,
    verify,
    model_class: str = "AutoModelForCausalLM",
    reduce_dtype=None,
    tiled_mlp="auto",
) -> dict[str, str]:
    """`plan` as given to from_pretrained: a Plan (its rules count) or a name ("auto", a model_type)."""
    import transformers

    from ..version import __version__

    settings = json.loads(config.to_json_string(use_diff=False))
    settings.pop("_name_or_path", None)  # a byte-identical copy in another folder is the same checkpoint
    return {
        "library versions (hf_rtp, transformers, torch)": (
            f"{__version__}, {transformers.__version__}, {torch.__version__}"
        ),
        "revision": commit or "a local folder",
        "config": _digest(json.dumps(settings, sort_keys=True).encode()),
        "tensor names, shapes and dtypes": _digest(
            json.dumps(sorted((n, str(e.dtype), list(e.shape)) for n, e in entries.items())).encode()
        ),
        "weight file headers": _headers(sorted({e.path for e in entries.values()}, key=os.path.basename)),
        "plan": plan
        if isinstance(plan, str)
        else f"{plan.name} " + _digest(json.dumps([sorted(plan.rotate.items()), list(plan.replicate)]).encode()),
        "rotation_piece_size": f"{piece_bytes} bytes",
        "dtype": str(dtype),
        "verify_weights": verify,
        "model class": model_class,
        "reduce_dtype": str(reduce_dtype or dtype),  # gradients of another size on the wire would be read as garbage
        "tiled_mlp": repr(tiled_mlp),
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


def file_identity(path: str) -> tuple[int, int, int]:
    """The file a path reaches (links followed): inode, size, mtime in ns. Not the device, which differs
    between the nodes mounting one network filesystem."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _hub_sha256(path: str) -> str | None:
    """The SHA-256 the Hub recorded for a cached file: its blob is named by it."""
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if os.path.basename(os.path.dirname(real)) == "blobs" and re.fullmatch(r"[0-9a-f]{64}", name):
        return name
    return None


def _files(entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """One entry per weight file, by file name (the same on every rank; the folders may differ)."""
    return {os.path.basename(e.path): e for e in sorted(entries.values(), key=lambda e: e.offset)}


def prove_files(entries: dict[str, TensorEntry], group, verify: str = "auto") -> dict[str, tuple]:
    """Collective. Prove, file by file, that every rank reads the same bytes (see the module's text);
    return each file's identity, which `agree_on_read` checks again after the read."""
    files = _files(entries)
    identities = {name: file_identity(e.path) for name, e in files.items()}
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if verify == "full":
            for e in files.values():
                _check_recorded(e, hash_file(e))
        return identities
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {name: (identities[name], _hub_sha256(e.path), e.blocks is not None) for name, e in files.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    hashed, todo = {}, _to_hash(everyone, verify)
    with agreed(group, CheckpointError):  # a read error too: every rank must reach the gather below
        for name, ranks in todo.items():
            if rank in ranks:
                hashed[name] = hash_file(files[name])
                _check_recorded(files[name], hashed[name])
    results: list = [None] * world
    dist.all_gather_object(results, hashed, group=group)
    differing = []
    for name in todo:
        seen = {r: h[name] for r, h in enumerate(results) if name in h}
        if len(set(seen.values())) > 1:
            differing.append(f"{name} ({', '.join(f'rank {r}: #{d[:12]}' for r, d in sorted(seen.items()))})")
    if differing:
        raise CheckpointError(
            "ranks loaded different models, which trained together would silently mix: the weight bytes differ in "
            + "; ".join(differing)
            + ". Every rank must load the same checkpoint: one folder, byte-identical copies, or one revision"
        )
    return identities


def _to_hash(everyone: list[dict], verify: str) -> dict[str, list[int]]:
    """File name -> the ranks that hash it whole: one per distinct copy, spread over the ranks sharing
    that copy, wherever no cheaper proof holds (or every file, with verify="full")."""
    todo, spread = {}, 0
    for name in everyone[0]:
        copies: dict[tuple, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            copies.setdefault(theirs[name][0], []).append(rank)
        hub = {theirs[name][1] for theirs in everyone}
        if verify != "full" and (len(copies) == 1 or (len(hub) == 1 and None not in hub) or everyone[0][name][2]):
            continue
        todo[name] = [ranks[spread % len(ranks)] for ranks in copies.values()]
        spread += 1
    if todo and verify != "full":
        warning(
            f"the ranks read {len(todo)} weight file(s) from different copies that carry no recorded hash, so one "
            "rank per copy hashes each file whole to prove the copies equal. Load from one shared folder, from the "
            "Hub cache, or a checkpoint saved by hf_rtp (which carries block digests) to skip this"
        )
    return todo


def hash_file(entry: TensorEntry) -> str:
    """SHA-256 of a whole weight file, read in 8 MB steps (nothing held), its block digests checked on the way."""
    hasher = hashlib.sha256()
    with open(entry.path, "rb", buffering=0) as f:
        position = 0
        while chunk := f.read(_READ):
            hasher.update(chunk)
            if entry.blocks is not None:
                _verify_blocks(entry, position, chunk)
            position += len(chunk)
    return hasher.hexdigest()


def _verify_blocks(entry: TensorEntry, position: int, chunk: bytes) -> None:
    """The part of a whole-file read that lies in the data section, against the recorded blocks."""
    assert entry.blocks is not None  # whole-file reads verify blocks only where the file records them
    start = entry.blocks.data_start
    if position + len(chunk) > start:
        skip = max(0, start - position)
        entry.blocks.verify(position + skip, memoryview(chunk)[skip:])


def _check_recorded(entry: TensorEntry, sha256: str) -> None:
    recorded = _hub_sha256(entry.path)
    if recorded is not None and recorded != sha256:
        raise CheckpointError(
            f"{entry.path} does not match the SHA-256 the Hub recorded for it ({recorded}): the cached file is "
            "damaged. "
            "Delete it from the cache and download it again"
        )


def agree_on_read(read: dict[str, str], identities: dict[str, tuple], entries: dict[str, TensorEntry], group) -> None:
    """Collective. After the read: every rank read the same bytes of every replicated tensor (their
    SHA-256s agree), and no file changed while it was being read."""
    changed = [name for name, e in _files(entries).items() if file_identity(e.path) != identities.get(name)]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if changed:
            raise CheckpointError(
                f"{', '.join(changed)} changed while it was being read: load again once it is complete"
            )
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (read, changed), group=group)
    for rank, (_, theirs) in enumerate(everyone):
        if theirs:
            raise CheckpointError(
                f"{', '.join(theirs)} changed while rank {rank} was reading it: load again once the checkpoint is "
                "complete"
            )
    reference = everyone[0][0]
    for rank, (theirs, _) in enumerate(everyone):
        differing = sorted(n for n in reference.keys() | theirs.keys() if theirs.get(n) != reference.get(n))
        if differing:
            raise CheckpointError(
                f"ranks loaded different models, which trained together would silently mix: rank {rank} read other "
                f"weight bytes than rank 0 for {', '.join(differing[:5])}"
                + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
                + ". Every rank must load the same checkpoint: one folder, byte-identical copies, or one revision"
            )


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes as read from the file (before any dtype conversion)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data if flat.numel() else b"").hexdigest()
