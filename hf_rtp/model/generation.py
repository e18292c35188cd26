"""generate() on a rotated model: every forward walks the ring, so every rank must keep stepping.

transformers stops a rank's loop when its own sequences are done, which would leave the others
waiting in the ring. With `synced_gpus=True` finished ranks keep running forward passes until all
ranks are done (as under DeepSpeed ZeRO-3 or FSDP). hf_rtp makes that the default at world size > 1,
and refuses `synced_gpus=False` there by name.

transformers' finished rank keeps stepping its own decode: its cache and positions go on past its own
length limit (a static cache or learned positions sized by its max_length overflow where another rank's
prompts are shorter), and an assisted decode asks its assistant for a negative number of tokens. hf_rtp's
finished rank instead leaves transformers' loop and, until every rank is done, makes the meeting transformers
makes each step and one forward of a single token without a cache (`_done_until_all_are`): the ring's walks
are the same, and nothing of its own decode moves. Its random state is left as it was when it finished, as
vanilla DDP's rank would have it (that rank stops there).

Ranks step together, so they must decode with the same settings: ranks that pass generate different
generation settings (max_new_tokens, sampling, beams, ...) fail at once, every rank naming the difference.
Each rank's inputs are its own, except that a chunked prefill (prefill_chunk_size) makes a forward per chunk,
so every rank's prompt must make as many chunks. An assistant model for assisted decoding must be a
transformers model: transformers sizes each rank's draft by that rank's remaining budget and skips it at 0,
so a rotated assistant's ring (or the model's own, drafting for itself: assistant_early_exit, use_mtp) would
be walked a different number of times on each rank.
"""

from __future__ import annotations

import copy
import re
import types

import torch
from transformers import GenerationConfig

from ..errors import CollectiveMisuseError
from . import traffic
from .context import refuse_inside
from .state import is_rotated, state_of

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's repr differs per process: compared by its type only
_DONE = "_has_unfinished_sequences"  # transformers' per-step check, which all-reduces whether each rank is done


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
    assistant = kwargs.get("assistant_model")
    settings["assistant_model"] = "none" if assistant is None else "rotated" if is_rotated(assistant) else "its own"
    if config.prefill_chunk_size:  # a forward per chunk of each rank's own prompt: ranks must make as many
        prompt = next(
            (kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds") if kwargs.get(k) is not None),
            args[0] if args else None,
        )
        if isinstance(prompt, torch.Tensor):
            length = prompt.shape[1] if prompt.dim() > 1 else prompt.shape[0]
            length -= _cached(kwargs.get("past_key_values"), kwargs.get("attention_mask"), length)
            settings["prompt's prefill chunks (prefill_chunk_size: give every rank prompts as long)"] = str(
                -(-length // config.prefill_chunk_size)
            )
    return settings


def _cached(cache, mask, length: int) -> int:
    """How many of a prompt's `length` tokens a passed cache holds already, which a chunked prefill skips as
    transformers' `_prefill` does: a prompt as long as its attention mask (or without one: generate makes it so) is
    the whole sequence, its first `cache.get_seq_length()` tokens cached; a shorter one is the new tokens alone."""
    if cache is None or not hasattr(cache, "get_seq_length") or all(getattr(cache, "is_linear", [False])):
        return 0
    if mask is not None and mask.shape[-1] != length:
        return 0
    return min(int(cache.get_seq_length()), length)


def generate(model, *args, synced_gpus: bool | None = None, **kwargs):
    refuse_inside(model, "generate()")
    topology = state_of(model).topology
    topology.enter("generate")
    if synced_gpus is None:
        synced_gpus = topology.world_size > 1
    settings = settings_of(model, args, kwargs, synced_gpus)
    topology.same_settings("generate", settings)
    if topology.world_size > 1:
        _refuse_unsynced(synced_gpus, settings)
        model.__dict__[_DONE] = types.MethodType(_done_until_all_are, model)
    try:
        return type(model).generate(model, *args, synced_gpus=synced_gpus, **kwargs)
    finally:
        model.__dict__.pop(_DONE, None)
        traffic.clear(topology.ring)


def _refuse_unsynced(synced_gpus: bool, settings: dict[str, str]) -> None:
    """On every rank alike (the settings compared equal): what generate cannot do on a ring."""
    if not synced_gpus:
        raise CollectiveMisuseError(
            "generate(synced_gpus=False) on a rotated model at world size > 1: every forward walks the ring, so a "
            "rank whose sequences are done must keep stepping until every rank is (each rank's tokens are the "
            "same either way). Leave synced_gpus unset, or pass True"
        )
    drafting = [k for k in ("assistant_early_exit", "use_mtp") if settings.get(k, "None") not in ("None", "False")]
    if settings["assistant_model"] == "rotated" or drafting:
        what = f"generate({drafting[0]}=...), where the model drafts for itself" if drafting else (
            "generate(assistant_model=...) with an assistant loaded by hf_rtp"
        )  # fmt: skip
        raise CollectiveMisuseError(
            f"{what}: transformers sizes each rank's draft by that rank's remaining budget and skips it at 0, so "
            "ranks would walk the drafting model's ring a different number of times. Load an assistant with "
            "transformers (a whole small model on each rank) and pass it as assistant_model, or pass "
            "prompt_lookup_num_tokens"
        )


def _done_until_all_are(model, this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
    """transformers' _has_unfinished_sequences, for a rank whose own sequences may be done: while other ranks are
    not, it makes their step's meeting and a forward of one token without a cache (its own decode left as it
    finished), then ends this rank's loop when every rank is done.

    Whether every rank is done is asked at hf_rtp's meeting (where forwards meet too), not by transformers'
    all-reduce on the default group: ranks that fell out of step (one in a forward, another asking) then fail at once
    on every rank, each call named, where the all-reduce waited out the default group's timeout and failed unnamed."""
    topology = state_of(model).topology

    def unfinished(finished: bool) -> bool:
        return any(row[0] for row in topology.enter("generate's step", payload=[0 if finished else 1]))

    if not this_peer_finished:
        return unfinished(False)
    ghost = torch.zeros((1, 1), dtype=torch.long, device=device)
    while unfinished(True):
        # dropout in a training-mode model would draw: the random state is left as the rank finished with it
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model(input_ids=ghost, use_cache=False)
    return False
