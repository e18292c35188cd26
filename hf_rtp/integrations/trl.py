"""TRL: its fused LM head (the `fused_lm_head=True` forward of SFT, DPO and GRPO) through hf_rtp's rotated loss.

TRL's `add_fused_lm_head` gathers the whole LM head on every rank (`lm_head.weight.full_tensor()`)
and computes per-token log-probs, entropy, log sum p^2, the mean logit and top-1 from it, at a
temperature, optionally with the head in float32. On a rotated model that is correct (hf_rtp gives the
gather's gradient the data-parallel mean) but holds the full head and its gradient on every rank. For a
rotated model, `add_fused_lm_head` below installs a forward that returns the same `FusedCausalLMOutput`,
with every option of TRL 1.16, computed as the head's pieces pass in the ring (hf_rtp.layers.fused_loss).

TRL's trainers call `add_fused_lm_head` after Trainer.__init__ has moved the model, which is where hf_rtp
adopts the trainer (integrations.trainer). Adoption points the name `add_fused_lm_head` in the
trainer's TRL modules at the function below, which stands in for `trl.trainer.utils.add_fused_lm_head`
(TRL 1.16, with the signature checked) and hands every model that is not rotated, and every head
or output it cannot compute (`_why_not`), to TRL's own. Outside those versions nothing is replaced, with a warning.

Likewise `create_model_from_path`, with which DPOTrainer and GRPOTrainer build their reference model
from the policy's path after Trainer.__init__: called by an adopted trainer whose policy is rotated,
for the policy's own path, it loads the reference rotated like the policy (the same ring and plan),
so no rank holds a whole copy; every other call goes to TRL's. A reward model that GRPOTrainer loaded
by name before Trainer.__init__ is whole on every rank: adoption says so in a warning, with its size; so
is a reference or teacher model that is whole when hf_rtp attaches (built before a delayed attachment).

And at adoption, `check_model_keywords`: a TRL trainer asked (through `args.model_init_kwargs` or its
`quantization_config=`) for a base other than the rotated model it was handed is refused, naming each keyword:
TRL applies them only to a model it loads from a path, so they would be dropped without an error.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from packaging.version import Version
from torch import nn

from .. import log
from ..errors import IntegrationError, SettingError
from ..layers import RotatedLinear
from ..layers.common import local
from ..layers.fused_loss import EXTRAS
from ..model import context
from ..model.forward import divisor
from ..model.fused_head import read_head, token_stats
from ..model.state import is_rotated, state_of
from ..private.transformers_names import attention_implementation

SUPPORTED_OUTPUTS = ("log_probs", *EXTRAS)  # every output TRL 1.16's kernel computes
_ORIGINAL = "_hf_rtp_original"
TESTED = ((1, 16), (1, 17))  # TRL versions whose add_fused_lm_head this stands in for: from, up to (excluded)
_PARAMETERS = {  # the TRL 1.16 signatures of what hf_rtp stands in for
    "add_fused_lm_head": ["model", "temperature", "cast_lm_head_to_fp32", "outputs"],
    "create_model_from_path": ["model_id", "architecture", "kwargs"],
}


def adopt(trainer, load: Callable[..., nn.Module], model=None) -> None:
    """Route `add_fused_lm_head` and `create_model_from_path` of every TRL module in `trainer`'s class
    hierarchy through hf_rtp; first, refuse a rotated `model` other than the one the trainer was asked to build.
    `load` (hf_rtp.from_pretrained, handed down) loads a reference model like the policy."""
    if model is not None:
        check_model_keywords(trainer, model)
    _refuse_context_parallel_beyond_sft(trainer)
    _warn_whole_reward_models(trainer)
    _warn_whole_references(trainer)
    modules = [sys.modules.get(cls.__module__) for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")]
    for name, replacement in (
        ("add_fused_lm_head", add_fused_lm_head),
        ("create_model_from_path", functools.partial(create_model_from_path, load=load)),
    ):
        originals = [getattr(m, name, None) for m in modules]
        if not any(o is not None and not hasattr(o, _ORIGINAL) for o in originals):
            continue
        reason = _unsupported(name)
        if reason is not None:
            log.warning(
                f"hf_rtp leaves TRL's {name} alone ({reason}): "
                + (
                    "with fused_lm_head=True it gathers the whole LM head on every rank"
                    if name == "add_fused_lm_head"
                    else "a reference model TRL builds from the policy's path is a whole copy on every rank; pass "
                    "ref_model=hf_rtp.from_pretrained(path) instead"
                )
            )
            continue
        for module, original in zip(modules, originals, strict=True):
            if original is not None and not hasattr(original, _ORIGINAL):
                routed = functools.wraps(original)(functools.partial(replacement, original=original))
                setattr(routed, _ORIGINAL, original)
                setattr(module, name, routed)


def _refuse_context_parallel_beyond_sft(trainer) -> None:
    """TRL's other trainers (DPO, GRPO, reward) reduce log-probabilities per sequence, of which each rank holds only
    its chunks under context parallelism: their losses would be every rank's part, silently. SFTTrainer's is
    Trainer's token mean, which hf_rtp's context parallelism makes the sequence's."""
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    trl_classes = [cls.__name__ for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")]
    if config is None or not config.cp_enabled or not trl_classes:
        return
    if "SFTTrainer" not in trl_classes:
        raise SettingError(
            f"context parallelism (cp_size={config.cp_size}) with TRL's {type(trainer).__name__} is not supported on a "
            "rotated model: its loss reduces log-probabilities per sequence, and each rank holds only part of every "
            "sequence. hf_rtp runs context parallelism for Trainer and TRL's SFTTrainer"
        )


_ONE_LINE = (
    "model=hf_rtp.from_pretrained(model_args.model_name_or_path, **training_args.model_init_kwargs, "
    "quantization_config=get_quantization_config(model_args))"
)


def check_model_keywords(trainer, model) -> None:
    """A TRL trainer builds its model from a path with `args.model_init_kwargs` and its `quantization_config=`;
    handed a loaded model, TRL only warns that it ignores them. With hf_rtp the script hands it the rotated model
    (TRL's scripts pass a path: the one line changed), so a keyword left out of hf_rtp.from_pretrained would train
    another base than the script asked for (an unquantized one, in another dtype or attention) with no error.
    Refused here, naming each keyword, at the trainer's construction."""
    asked = dict(getattr(getattr(trainer, "args", None), "model_init_kwargs", None) or {})
    given = _init_argument(trainer, "quantization_config")
    if given is not None:
        asked["quantization_config"] = given
    config = model.config
    problems = []
    dtype = asked.get("dtype", asked.get("torch_dtype"))
    if dtype is not None and dtype != "auto":
        wanted = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype
        if wanted != getattr(config, "dtype", None):
            problems.append(f"dtype={dtype!r} (the model holds {getattr(config, 'dtype', None)})")
    attention = asked.get("attn_implementation")
    if attention is not None and attention != attention_implementation(config):
        problems.append(f"attn_implementation={attention!r} (the model runs {attention_implementation(config)!r})")
    wanted_quantization = _quantization(asked.get("quantization_config"))
    held = _quantization(
        getattr(config, "quantization_config", None) if getattr(model, "is_quantized", False) else None
    )
    if wanted_quantization is not None and wanted_quantization != held:
        problems.append(f"quantization_config={_described(wanted_quantization)} (the model is {_described(held)})")
    if problems:
        raise IntegrationError(
            f"{type(trainer).__name__} was asked for a model built with {'; '.join(problems)}, and given a model "
            "hf_rtp loaded otherwise. TRL applies those keywords only when it loads the model from a path, so it "
            "would train another base than the script asks for. Pass them all to hf_rtp.from_pretrained, as in "
            f"TRL's scripts: {_ONE_LINE}"
        )


def _init_argument(trainer, name: str, depth: int = 48):
    """The value of `name` in the __init__ of `trainer` that is on the stack (TRL's trainers take
    `quantization_config=` there and keep it nowhere), or None."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is trainer and name in frame.f_locals:
            return frame.f_locals[name]
        frame = frame.f_back
    return None


def _quantization(config) -> dict | None:
    """A quantization config as the settings that make the base (a dict, or a BitsAndBytesConfig)."""
    if config is None:
        return None
    found = config if isinstance(config, dict) else config.to_dict()
    return {k: str(getattr(v, "value", v)) for k, v in found.items() if not k.startswith("_")}  # enums by value


def _described(settings: dict | None) -> str:
    if settings is None:
        return "not quantized"
    keys = ("quant_method", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
    return "{" + ", ".join(f"{k}={settings[k]}" for k in keys if k in settings) + "}"


def create_model_from_path(model_id, architecture=None, *, original, load, **kwargs):
    """TRL's `create_model_from_path`; for the policy's own path under an adopted trainer whose policy is
    rotated (the reference model), `load` (hf_rtp's from_pretrained) with the policy's settings, ring and plan
    (its state's LoadSpec)."""
    trainer = sys._getframe(1).f_locals.get("self")  # the trainer whose __init__ builds the reference
    policy = getattr(trainer, "model", None)
    state = state_of(policy, required=False) if isinstance(policy, nn.Module) else None
    if (
        state is None
        or state.spec is None
        or model_id != getattr(getattr(policy, "config", None), "_name_or_path", None)
    ):
        return original(model_id, architecture, **kwargs)
    if kwargs.pop("quantization_config", None) is not None:
        raise IntegrationError(
            f"{type(trainer).__name__} asks for a quantized reference model; hf_rtp loads float weights "
            "only. Pass ref_model= yourself, or drop the quantization config"
        )
    if kwargs.pop("device_map", None) not in (None, "auto"):
        raise IntegrationError("hf_rtp places the reference model itself, one chunk per rank: drop device_map")
    if kwargs.pop("trust_remote_code", False):
        raise IntegrationError("hf_rtp does not load remote code: the reference model must be a transformers class")
    reference = load(model_id, auto_class=architecture, **{**state.spec.keywords(), **kwargs})
    log.info(
        f"{type(trainer).__name__}'s reference model is rotated like the policy: "
        f"{_bytes_here(reference) / 2**20:.1f} MB of weights on this rank"
    )
    return reference


def _bytes_here(model: nn.Module) -> int:
    """Bytes of weights this rank holds: its chunk of rotated parameters, all of the others."""
    with torch.no_grad():
        return sum(local(p).nbytes for p in model.parameters())


def _warn_whole_reward_models(trainer) -> None:
    for reward in getattr(trainer, "reward_funcs", None) or []:
        if isinstance(reward, nn.Module) and not is_rotated(reward):
            log.warning(
                f"{type(trainer).__name__}'s reward model {type(reward).__name__} is whole on every rank "
                f"({_bytes_here(reward) / 2**20:.1f} MB each) beside a rotated policy. To rotate it too, pass "
                "reward_funcs=hf_rtp.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)"
            )


def _warn_whole_references(trainer) -> None:
    """A reference or teacher model that is already whole when hf_rtp attaches: TRL built it with vanilla
    from_pretrained before the attachment (place_model_on_device=False, bf16_full_eval or fp16_full_eval
    delay it to the first forward), or the user passed one. Its memory is spent: say so, with the call."""
    for attribute in ("ref_model", "teacher_model"):
        reference = getattr(trainer, attribute, None)
        if isinstance(reference, nn.Module) and not is_rotated(reference):
            log.warning(
                f"{type(trainer).__name__}.{attribute} ({type(reference).__name__}) is a whole copy on every rank "
                f"({_bytes_here(reference) / 2**20:.1f} MB each) beside a rotated policy: it was built before hf_rtp "
                "attached to the trainer (TrainingArguments' place_model_on_device=False, bf16_full_eval or "
                f"fp16_full_eval delay that to the first forward), or passed whole. To rotate it, pass "
                f"{attribute}=hf_rtp.from_pretrained(path) to {type(trainer).__name__}"
            )


def replace_installed_head(model) -> None:
    """A rotated model whose forward is TRL's own fused head (a TRL trainer attached only after its
    __init__ installed it, which gathers the whole head on every rank): the same options, on the ring.
    TRL's forward keeps what it was given in its closure; without those names hf_rtp refuses."""
    forward = getattr(model.forward, "__func__", None)
    # functools.wraps gave it the model's forward's names: the code and the globals tell whose it is
    if (
        forward is None
        or forward.__code__.co_name != "_fused_forward"
        or not forward.__globals__.get("__name__", "").startswith("trl.")
    ):
        return
    given = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__ or ()), strict=True))
    wanted = ("original_forward", "temperature", "cast_lm_head_to_fp32", "outputs")
    reason = _unsupported() or (None if all(k in given for k in wanted) else f"its fused forward keeps {sorted(given)}")
    if reason is not None:
        raise IntegrationError(
            f"TRL installed its own fused LM head on the rotated model before hf_rtp was attached to the trainer, and "
            f"hf_rtp cannot take it over ({reason}): it would gather the whole head on every rank. Build the trainer "
            "so that it places the model (no place_model_on_device=False, bf16_full_eval or fp16_full_eval)"
        )
    from trl.trainer import utils

    model.forward = given["original_forward"]
    add_fused_lm_head(
        model,
        given["temperature"],
        given["cast_lm_head_to_fp32"],
        tuple(given["outputs"]),
        original=utils.add_fused_lm_head,
    )


def _unsupported(name: str = "add_fused_lm_head") -> str | None:
    """Why this TRL's `name` is not the one hf_rtp stands in for; None when it is."""
    import trl
    from trl.trainer import utils

    if not TESTED[0] <= Version(trl.__version__).release[:2] < TESTED[1]:
        return f"TRL {trl.__version__} is outside the versions it was checked against, >=1.16 and <1.17"
    found = list(inspect.signature(getattr(utils, name)).parameters)
    if found != _PARAMETERS[name]:
        return f"trl.trainer.utils.{name} takes {found}, not {_PARAMETERS[name]}"
    return None


def _why_not(model, outputs) -> str | None:
    if not set(outputs) <= set(SUPPORTED_OUTPUTS):
        return f"it asks for {sorted(set(outputs) - set(SUPPORTED_OUTPUTS))}, which hf_rtp does not compute"
    return read_head(model)[1]


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    original,
) -> None:
    """TRL's `add_fused_lm_head`, with the rotated loss for rotated models (see the module docstring)."""
    if not is_rotated(model):
        return original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    if cast_lm_head_to_fp32:
        _rotate_cast_head(model)
    reason = _why_not(model, outputs)
    if reason is not None:
        log.warning(f"TRL's fused LM head gathers the whole head on every rank here, because {reason}")
        return original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    install(model, outputs, temperature, cast_lm_head_to_fp32)


def _rotate_cast_head(model) -> None:
    """GRPOTrainer(cast_lm_head_to_fp32=True) casts the head to float32 and, just before calling add_fused_lm_head,
    sets its forward to `F.linear(hidden.float(), weight.float(), bias)`: on the rotated weight that would make
    generate's logits a DTensor (the next token's ids with them). The same map on the ring: the rotated head's own
    forward on float32 hidden states, autocast as the caller has it, as F.linear's."""
    head = model.get_output_embeddings()
    replaced = head.__dict__.get("forward")
    if not isinstance(head, RotatedLinear) or replaced is None or getattr(replaced, "hf_rtp_cast", False):
        return

    def forward(hidden_states):
        return RotatedLinear.forward(head, hidden_states.to(torch.float32))

    forward.hf_rtp_cast = True  # type: ignore[attr-defined]
    head.forward = forward  # type: ignore[method-assign]  # an instance attribute, as TRL set it


def install(model, outputs: tuple[str, ...], temperature: float = 1.0, cast_lm_head_to_fp32: bool = False) -> None:
    """Give `model`, whose head `read_head` accepts, TRL's `fused_lm_head=True` forward on the ring, with
    TRL's options: its kernel's transforms (`HeadTransform`'s in_float32 and temperature) and, with
    `cast_lm_head_to_fp32`, float32 hidden states and the projection outside autocast, as TRL's forward."""
    from trl.trainer.utils import FusedCausalLMOutput

    transforms, reason = read_head(model)
    if reason is not None:
        raise ValueError(f"hf_rtp cannot compute {type(model).__name__}'s fused LM head: {reason}")
    text_config = model.config.get_text_config()
    vocab, extras = text_config.vocab_size, tuple(name for name in EXTRAS if name in outputs)
    plain_forward = model.forward

    @functools.wraps(type(model).forward)  # generate validates its kwargs against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return plain_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        run = context.active(self)
        facts = None
        if run is not None:  # SFTTrainer under Trainer's context parallelism: it divides by Trainer's token count
            facts = context.check(run, {**kwargs, "labels": labels, "shift_labels": shift_labels})
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        before = run.calls if run is not None else 0
        backbone = self.base_model(*args, **kwargs)
        if run is not None:
            context.attended(run, before)
        hidden = backbone.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask, found = per_token(self, hidden, labels.to(hidden.device))
        log_probs = found.pop("log_probs")
        # the mean over label tokens (the whole sequence's under context parallelism), at least 1 as TRL's
        loss = -log_probs.sum() / divisor(num_items_in_batch, facts, mask, at_least=1, device=mask.device)
        if run is not None:  # its loss has the one meaning of a forward in a block (model/context/loss.py)
            loss = context.sequence_loss(run, loss)
        aux_loss: Any = None  # transformers' load_balancing_loss_func: a tensor, or 0 without router logits
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            aux_loss = load_balancing_loss_func(
                backbone.router_logits,
                text_config.num_experts,
                text_config.num_experts_per_tok,
                kwargs.get("attention_mask"),
            )
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, **found, label_mask=mask, aux_loss=aux_loss)

    def per_token(self, hidden, labels):
        """TRL's kernel on the ring: each output back to [batch, seq], zero where the label is ignored."""
        mask = labels != -100
        autocast: Any = nullcontext()
        if cast_lm_head_to_fp32:  # as TRL's forward: float32 hidden states, the projection outside autocast
            hidden, autocast = hidden.float(), torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            found = token_stats(
                self, hidden[mask], labels[mask], vocab, transforms, extras, temperature=temperature, in_float32=True
            )
        found["log_probs"] = -found.pop("nll")
        # masked_scatter keeps an all-ignored batch in the graph
        return mask, {name: x.new_zeros(mask.shape).masked_scatter(mask, x) for name, x in found.items()}

    model.forward = types.MethodType(forward, model)
