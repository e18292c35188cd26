"""hf_rtp's ring attention registered with transformers under one new name, `hf_rtp_context`.

A model's config names it only inside a context-parallel block of that model (block.py sets it and sets it back),
through the registration transformers documents for custom attention (`AttentionInterface`,
`AttentionMaskInterface`): no other model's attention changes. What the ring attention does not compute is refused
here by name, the same on every rank (it is the model's, not the data's); so is a device, dtype or head size no
kernel takes (layers/attention_kernels.py), and a kernel whose probe fails (`trust_kernels`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...errors import HfRtpError, SettingError
from ...layers.attention import ring_attention, trusted
from .run import ATTENTION, ContextRun, current


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface under the name ATTENTION: ring attention inside a block."""
    run = current()
    if run is None:  # a config that kept the name past its block (a copy made inside it): no sequence to attend to
        raise HfRtpError(
            f"{type(module).__name__} runs the attention implementation {ATTENTION!r} outside a context-parallel "
            "block: a config copied inside the block kept it. Set config._attn_implementation = 'sdpa' on the copy"
        )
    _check_attention(run, module, query, attention_mask, dropout, kwargs)
    run.calls += 1
    facts = run.facts_for(kwargs.get("position_ids"))
    out = ring_attention(query, key, value, scaling, run.ring, run.layout, facts.documents if facts else None)
    if out.requires_grad:
        run.graphs += 1
        out.register_hook(lambda grad: _backward_seen(run, grad))
    return out.transpose(1, 2).contiguous(), None


def _backward_seen(run: ContextRun, grad):
    run.backward_ran = True
    return grad


def _check_attention(run: ContextRun, module, query, attention_mask, dropout, kwargs) -> None:
    """What the ring attention does not compute, refused by name (the same on every rank: it is the model's)."""
    name = type(module).__name__
    reasons = []
    if attention_mask is not None:
        reasons.append("a 4-D attention mask (only the causal mask of one whole sequence is supported)")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        reasons.append("non-causal attention")
    if module.training and dropout:
        reasons.append(f"attention dropout ({dropout}); set config.attention_dropout = 0.0")
    window = kwargs.get("sliding_window")
    if window is not None and window < run.layout.length:
        reasons.append(f"a sliding window of {window} tokens, shorter than the sequence ({run.layout.length})")
    if kwargs.get("softcap") is not None:
        reasons.append("attention logit soft-capping")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        reasons.append("attention sinks")
    if query.shape[2] != run.layout.local_length(run.rank):
        reasons.append(
            f"{query.shape[2]} query tokens where this rank holds {run.layout.local_length(run.rank)} of the sequence"
        )
    if reasons:
        raise SettingError(f"context parallelism: {name} uses " + "; ".join(reasons))


def trust_kernels(run: ContextRun, kwargs: dict) -> None:
    """The ring attention's kernel for this forward, chosen and probed on this rank (layers.attention.trusted: once
    per process and kernel), from the heads the config declares and the dtype and device the embeddings give (the
    autocast dtype under autocast). inputs.check calls it inside its agreement, so that a kernel one rank refuses is
    refused on every rank before any K/V block walks the ring. An attention that runs in another dtype or head size
    than these is probed at its own first call instead, where a refusal is this rank's alone (the others then fail
    by the ring's timeout)."""
    model: Any = run.model
    try:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
        value = getattr(config, "v_head_dim", None) or head
        groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
        like = kwargs.get("inputs_embeds")
        like = like if like is not None else model.get_input_embeddings().weight
    except (AttributeError, TypeError, ZeroDivisionError, NotImplementedError):
        return  # not a shape this reads: the attention's first call probes its kernel
    if not (torch.is_tensor(like) and like.is_floating_point() and isinstance(head, int) and isinstance(value, int)):
        return
    dtype = like.dtype
    if torch.is_autocast_enabled(like.device.type) and dtype != torch.float64:  # as ring_attention casts, and SDPA
        dtype = torch.get_autocast_dtype(like.device.type)
    trusted(like.device, dtype, head, value, max(groups, 1))


def _mask(*args, **kwargs):
    """The mask interface under ATTENTION: no mask, the ring attention is causal over global positions
    (inputs.py checks that a 2-D mask only pads on the right, on every rank together)."""
    return None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)  # a new name: no other model's attention changes
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask)


def attended(run: ContextRun, before: int) -> None:
    """After a forward: every decoder layer's attention ran the ring's. A model whose layers call SDPA themselves
    (Falcon) attended to each rank's chunks alone, the same on every rank: refused before any backward."""
    config: Any = run.model.config
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    ran = run.calls - before
    if layers is not None and ran != layers:
        raise SettingError(
            f"context parallelism is not supported for {type(run.model).__name__}: {ran} of its {layers} layers' "
            "attention went through transformers' attention interface, where hf_rtp's ring attention runs; the "
            "others call SDPA themselves, on each rank's chunks alone"
        )


@functools.cache
def _module_calls_interface(module_name: str) -> bool:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True  # no source to read: the count after each forward (attended) still guards it
    return "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source


def calls_attention_interface(model: nn.Module) -> bool:
    """Whether the model's code reaches attention through transformers' interface (read once per modeling file;
    `attended` checks every forward's count besides)."""
    return _module_calls_interface(type(model).__module__)
