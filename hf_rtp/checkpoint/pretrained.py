"""save_pretrained and push_to_hub as a rotated model's methods: vanilla's keywords, the collective write
(save.py), and for a push, one Hub commit of exactly the files that save wrote plus the model card vanilla
adds, as transformers' `_upload_modified_files` does.

A folder is the user's (Trainer's output_dir holds `checkpoint-*/optimizer.pt`, people keep notes
beside their weights), so the commit lists the saved files one by one; nothing else in the folder is
ever read for an upload. The card is built in memory and never written into the user's folder.
"""

from __future__ import annotations

import os
import tempfile

from ..distributed.ranks.agreement import agreed
from ..distributed.ranks.topology import Topology
from ..errors import CheckpointError, KeywordError, SettingError
from ..log import warning
from ..model.state import state_of
from .save import write

# what accelerate and Trainer pass for pickle-based saves and PEFT's key format: meaningless for a gathered
# safetensors save of a whole model
_IGNORED_KWARGS = {"save_function", "save_peft_format"}

# what save_pretrained(push_to_hub=True, ...) takes for the push, with vanilla's meaning (vanilla passes
# what it does not pop to `create_repo`, of which hf_rtp takes `private`; anything else is refused)
_SAVE_PUSH_KWARGS = ("repo_id", "commit_message", "create_pr", "private")


def save_pretrained(
    model,
    save_directory: str | os.PathLike,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    safe_serialization: bool = True,
    variant: str | None = None,
    token: str | bool | None = None,
    **kwargs,
) -> None:
    """Write a standard Hugging Face checkpoint. Collective: every rank calls it; one rank writes.

    `is_main_process` (accelerate and Trainer pass `accelerator.is_main_process`) chooses whether a checkpoint is
    written at all: False on every rank writes nothing, as in vanilla; otherwise the writer is always ring rank 0
    of the first replica (global rank 0 unless a device_mesh orders ranks otherwise), because every
    rank of its ring must take part in gathering the rotated tensors. Called
    on some ranks only (`if accelerator.is_main_process:`), it fails on them within the entry
    timeout with a CollectiveMisuseError instead of waiting.

    With `push_to_hub=True` the files this save wrote (and a model card, as vanilla adds) are then
    uploaded, nothing else the folder holds; `repo_id`, `commit_message`, `create_pr` and `private`
    have vanilla's meaning.
    """
    topology: Topology = state_of(model).topology
    asked = topology.enter("save_pretrained", payload=[int(bool(is_main_process))])
    if not safe_serialization:
        raise SettingError("hf_rtp writes safetensors only; drop safe_serialization=False")
    for name in _IGNORED_KWARGS:
        kwargs.pop(name, None)
    original_format = bool(kwargs.pop("save_original_format", True))  # False: the model's own names, as vanilla
    if kwargs.pop("distributed_checkpoint", False):
        raise KeywordError(
            "save_pretrained(distributed_checkpoint=True): hf_rtp writes one gathered safetensors checkpoint (vanilla "
            "raises here for a model that is neither FSDP nor tensor parallel). Drop the keyword; for a sharded "
            "save of the training state, hf_rtp.save_training_state"
        )
    if variant is not None:
        raise KeywordError("hf_rtp does not write weight variants yet: drop variant=")
    if not any(row[0] for row in asked):  # no rank is the main process: vanilla then writes nothing
        if os.path.isfile(save_directory):
            raise NotADirectoryError(f"{save_directory} is a file; save_pretrained needs a directory")
        os.makedirs(save_directory, exist_ok=True)
        return
    if push_to_hub:
        return push_saved(model, save_directory, state_dict, max_shard_size, token, original_format, **kwargs)
    for name in sorted(kwargs):
        warning(f"save_pretrained ignores {name}=")
    write(model, save_directory, state_dict, max_shard_size, original_format)


def push_to_hub(
    model,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | str | None = None,
):
    """Vanilla's `model.push_to_hub`: save into a scratch folder (collectively), then the rank that wrote it
    commits those files. Returns huggingface_hub's CommitInfo on the writer, None on the other ranks."""
    topology: Topology = state_of(model).topology
    topology.enter("push_to_hub")
    with tempfile.TemporaryDirectory(prefix="hf_rtp-push-") as folder:
        written = write(model, folder, None, max_shard_size or "50GB")
        return _upload_on_writer(
            model,
            folder,
            written,
            repo_id,
            commit_message=commit_message,
            commit_description=commit_description,
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
            tags=tags,
        )


def push_saved(
    model,
    save_directory: str | os.PathLike,
    state_dict,
    max_shard_size: int | str,
    token,
    original_format: bool = True,
    **kwargs,
):
    """save_pretrained(..., push_to_hub=True): the save into `save_directory`, then its files pushed."""
    unknown = sorted(set(kwargs) - set(_SAVE_PUSH_KWARGS))
    if unknown:
        raise KeywordError(
            f"save_pretrained(push_to_hub=True) got keyword arguments hf_rtp does not pass on: {', '.join(unknown)} "
            f"(it takes {', '.join(_SAVE_PUSH_KWARGS)}; call model.push_to_hub(...) for the others)"
        )
    folder = os.fspath(save_directory)
    repo_id = kwargs.pop("repo_id", None) or os.path.basename(folder.rstrip(os.sep))
    written = write(model, folder, state_dict, max_shard_size, original_format)
    _upload_on_writer(model, folder, written, repo_id, token=token, **kwargs)


def _upload_on_writer(model, folder: str, written: list[str], repo_id: str, **options):
    topology: Topology = state_of(model).topology
    result = None
    with agreed(topology.control, CheckpointError):  # the writer's failure is every rank's error
        if topology.is_writer:
            result = upload(model, folder, written, repo_id, **options)
    return result


def upload(
    model,
    folder: str,
    files: list[str],
    repo_id: str,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    tags: list[str] | str | None = None,
):
    """One commit of `files` (names inside `folder`) and a model card, as vanilla's push makes it."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from transformers.utils.hub import create_and_tag_model_card

    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        # the card's lookup takes a token string; True (the stored token) is its default anyway
        card = create_and_tag_model_card(repo_id, _tags(model, tags), token=token if isinstance(token, str) else None)
        operations = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=os.path.join(folder, n)) for n in files]
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode()))
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
        return api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message or _default_message(model),
            commit_description=commit_description,
            token=token,
            create_pr=create_pr,
            revision=revision,
        )
    except Exception as err:
        raise CheckpointError(
            f"could not push {folder} to the Hub as {repo_id} ({type(err).__name__}: {err}). "
            "The checkpoint itself is complete: check your token and network (and HF_HUB_OFFLINE), "
            "or upload the folder later with `hf upload`."
        ) from err


def _tags(model, tags: list[str] | str | None) -> list[str]:
    """The model's own tags (TRL adds its own) and the ones passed, as vanilla's push_to_hub merges them."""
    merged = list(getattr(model, "model_tags", None) or [])
    for tag in [tags] if isinstance(tags, str) else tags or []:
        if tag not in merged:
            merged.append(tag)
    return merged


def _default_message(model) -> str:
    name = type(model).__name__
    return "Upload model" if "Model" in name else f"Upload {name}"
