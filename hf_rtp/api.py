"""from_pretrained: orchestration only, each step in its own module; and `bind`, the one place that
attaches anything to a loaded model."""

from __future__ import annotations

import copy
import functools
import os
import re
import stat
import types
from datetime import timedelta
from typing import Any

import torch
import transformers
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig, PreTrainedModel

from . import faults, keywords, log, plans
from .checkpoint import quantized as quantized_checkpoint
from .checkpoint.files import find_weights, resolve_directory
from .checkpoint.fingerprint import agree, fingerprint
from .checkpoint.keys import untie_stored_apart, wants_for
from .checkpoint.load import read_proven
from .checkpoint.pretrained import push_to_hub, save_pretrained
from .distributed.agreement import agreed
from .distributed.rotated import COMPILE_REFUSED, keep_rotated
from .distributed.topology import setup
from .errors import CheckpointError, KeywordError, RotatedStateError, SettingError, TopologyError
from .integrations import bitsandbytes, torchao
from .integrations.accelerate import adopt_caller as adopt_accelerator
from .integrations.accelerate import check_accelerate_state
from .integrations.peft import install_when_peft_is_imported
from .integrations.trainer import adopt_caller, check_attached, refuse_unattached_save
from .model import traffic
from .model.data_parallel import ignore_rotated_in_ddp
from .model.fused_head import install_forward
from .model.generation import generate
from .model.heads import fresh_head, initialise_head, is_causal_lm, model_class
from .model.install import install
from .model.state import ATTRIBUTE, RTPState
from .model.ties import tie_targets
from .model.vocabulary import resize_token_embeddings
from .plans.auto import auto_plan
from .private.transformers_names import float32_patterns
from .settings import DEFAULT_PIECE_SIZE, Settings


def from_pretrained(
    pretrained_model_name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | dict | None = None,
    device: str | torch.device | None = None,
    device_mesh: DeviceMesh | None = None,
    rtp_size: int | None = None,
    plan: plans.Plan | str | None = None,
    timeout: float | timedelta | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
    rotation_piece_size: int | str = DEFAULT_PIECE_SIZE,
    fused_loss: bool = True,
    verify_weights: str = "auto",
    auto_class=None,
    reduce_dtype: str | torch.dtype | None = None,
    rotation_moves: str = "auto",
    **kwargs,
) -> PreTrainedModel:
    """Load a checkpoint with its weights rotated across all ranks. Every rank calls it.

    Returns the real transformers class (e.g. LlamaForCausalLM) with vanilla's parameter names and
    global shapes; rotated parameters are Shard(0) DTensors on the `rtp` mesh, of which this rank
    holds and reads from disk only its own chunk. Under torchrun or `accelerate launch` the process
    group is started from the environment if needed (NCCL for CUDA, gloo on CPU); in a single
    process the model is plain PyTorch.

    Args:
        dtype: "auto" (the checkpoint's config.dtype, as transformers does; also what None, the default, means)
            or a torch dtype. A dict of per-sub-config dtypes is taken as transformers 5 takes it: its "" entry
            (else torch's default dtype) for every module, with vanilla's deprecation warning.
        device: where parameters live; default this rank's GPU (LOCAL_RANK) if CUDA is present, else CPU.
        device_mesh: the ranks to rotate on, made for you by default: a 1-D mesh over all ranks (one
            ring), or a 2-D mesh with dims named ("dp", "rtp"), whose every row is a ring.
        rtp_size: ranks per ring (default: all ranks, one flat ring). A divisor K of the world size
            lays the ranks out as world/K data-parallel replicas of K-rank rings, each ring of
            contiguous ranks (under torchrun, inside a node): every rank holds 1/K of each rotated
            weight, and each gradient is still DDP's mean over all ranks' batches. 1: plain data
            parallel, nothing rotated.
        plan: what to rotate. Default: the plan registered for config.model_type. A Plan, the
            model_type of a registered plan, or "auto" (rotate every Linear, Conv1D and Embedding).
        timeout: seconds (or timedelta) any collective hf_rtp issues may wait before failing; default
            HF_RTP_TIMEOUT, else 10 minutes. Calls every rank must make (forward, generate, save) fail
            within HF_RTP_ENTRY_TIMEOUT seconds (default 60) when a rank does not make them.
        rotation_piece_size: chunks larger than this (bytes, or a string like "16MB") travel the ring
            in pieces, which bounds the rotation buffers every rank keeps (four such pieces at most).
        fused_loss: in training, a forward with `labels` computes transformers' causal-LM loss through
            the rotated LM head without building the [tokens, vocab] logits; its output's `logits` is
            then None (pass `return_logits=True` to the forward to get them). Evaluation, generate and
            forwards without labels always return logits. Families whose head the fused loss cannot
            reproduce keep the plain loss (logged). False: always the plain loss.
        verify_weights: how ranks prove they read the bytes of one checkpoint. "auto": by the cheapest
            proof that holds per file (one shared file, the Hub's recorded hash, hf_rtp's block digests,
            else one whole-file hash per copy); replicated tensors are always compared in full. "full":
            also hash every file whole (one rank per copy) against every recorded hash.
        auto_class: the transformers auto class to build: AutoModelForCausalLM (default),
            AutoModelForSequenceClassification (reward models, classifiers), AutoModelForTokenClassification or
            AutoModelForImageTextToText (Qwen2-VL, Qwen2.5-VL: the language model rotated, the vision tower whole);
            or call hf_rtp.AutoModelFor....from_pretrained. A head the checkpoint lacks (a reward model made
            from a causal LM) is initialised as vanilla initialises it, on rank 0, and sent to every rank.
        reduce_dtype: the dtype rotated gradients travel the ring and are summed in, as FSDP2's
            MixedPrecisionPolicy(reduce_dtype=...); default None, the parameter's dtype (float32 master
            weights keep float32 sums). `.grad` and the optimizer keep the parameter's dtype either way,
            and on a 2-D grid the sum over replicas runs on `.grad`, in that dtype.
            Weights need no setting: under autocast they travel in its dtype (bf16 over float32
            weights sends half the bytes, with the same matmul inputs as casting at each matmul).
        rotation_moves: what a rotated op moves around the ring in a forward. "auto" (default): whichever
            costs less for this forward's tokens (bytes, and a message's latency per hop), the op's weight
            pieces (training, prefill, small layers) or the tokens' inputs and outputs (a decode step: each
            rank applies its own rows to every rank's tokens and the outputs go home); the same outputs
            either way. "weights" forces the first; "activations" the second wherever it can run: in
            forwards whose ranks counted their tokens (text inputs), for tokens that fit the ring's two weight
            slots (moving tokens takes no memory of its own). Backward always moves weights. Every rank must
            pass the same value.
        kwargs: transformers' own keywords, with vanilla's meaning: `config=`, `subfolder`, `variant`,
            `use_safetensors`, `output_loading_info` (then a (model, info) pair is returned),
            `generation_config`, `torch_dtype`, `device_map` that puts the whole model on one device
            (`{"": local_rank}`), `low_cpu_mem_usage` (a no-op, as in vanilla), `trust_remote_code` (a
            checkpoint of a built-in architecture loads as vanilla loads it; one whose config maps the model or
            config class to its own code, which vanilla would run, is refused by name); and overrides for
            config.json (e.g. attn_implementation="eager"). Those hf_rtp cannot honour (`device_map="auto"`,
            `tp_plan`, `quantization_config`, ...) are refused by name with the reason: see hf_rtp/keywords.py.
    """
    options = keywords.resolve(kwargs, dtype, device)
    dtype, device = options.dtype, options.device
    settings = Settings.resolve(
        device, timeout, rotation_piece_size, verify_weights, fused_loss, reduce_dtype, rotation_moves
    )
    topology = setup(settings, device_mesh, rtp_size)
    with agreed(topology.control, TopologyError):
        faults.check()  # a misspelt fault point is an error, not a test that injects nothing
    check_accelerate_state(topology.world_size)  # an Accelerator that runs undistributed: fail before loading
    directory, commit = _resolve(
        pretrained_model_name_or_path, options.subfolder, revision, token, cache_dir, local_files_only, topology.control
    )
    _refuse_remote_code(directory, options, auto_class)  # before the config is built: that may be remote code too
    config = _config(directory, options)
    stored_quantization = bitsandbytes.stored_config(config)  # saved quantized by bitsandbytes: read as stored
    if stored_quantization is None:
        _refuse_quantized(config)
    elif options.quantization_config is not None:
        log.warning(  # vanilla's merge_quantization_configs: the checkpoint's own config wins
            "this checkpoint is already quantized by bitsandbytes: its own quantization_config is used, the one "
            "passed to from_pretrained is ignored (as transformers does)"
        )
    quantization = stored_quantization or options.quantization_config
    if quantization is not None:
        config.quantization_config = quantization  # as vanilla records it; in the fingerprint
    auto_class = model_class(auto_class, config)  # before any read: a wrong head fails naming the right one
    plan = plans.get(config.model_type) if plan is None else plan  # an unknown architecture fails here, early
    plan = _named_plan(plan)
    with agreed(topology.control, CheckpointError):  # one rank's bad file is everyone's error
        entries = find_weights(directory, options.variant).tensors()
    dtype = _resolve_dtype(dtype, config, entries)
    config.dtype = dtype  # as vanilla records it
    # before any other collective: ranks holding other files would otherwise meet in different ones
    agree(
        fingerprint(
            commit=commit,
            config=config,
            entries=entries,
            plan=plan,
            piece_bytes=settings.piece_bytes,
            dtype=dtype,
            verify=settings.verify_weights,
            model_class=auto_class.__name__,
            reduce_dtype=settings.reduce_dtype,
        ),
        topology.control,
    )

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary) computed for real
        model = auto_class.from_config(config, dtype=dtype)
    _keep_float32(model, dtype)
    untie_stored_apart(model, entries, topology)
    plan = _choose_plan(plan, model)
    resolution = plan.resolve(model)
    quantized = {}
    if quantization is not None:
        quantized = bitsandbytes.select(model, resolution, quantization, dtype, topology.rtp_size)

    with agreed(topology.control, CheckpointError):  # file reads: one rank's failure is every rank's error
        if stored_quantization is not None:
            quantized = quantized_checkpoint.stored_specs(quantized, quantization, entries)
        wants, sources = wants_for(model, resolution, topology, entries)
    lacking = sorted(n for n, want in wants.items() if any(name not in entries for name in want.source.names))
    fresh = fresh_head(model, lacking, resolution.rotated_params)
    for name in fresh:
        del wants[name], sources[name]
    if stored_quantization is not None:
        with agreed(topology.control, CheckpointError):
            quantized_checkpoint.read_stored(quantized, model, wants, entries)
    transforms = bitsandbytes.quantizers(quantized) if stored_quantization is None else None
    tensors = read_proven(entries, wants, dtype, topology, settings.verify_weights, transforms=transforms)
    if quantized:
        bitsandbytes.finish(model, quantized, tensors, quantization, topology, stored=stored_quantization is not None)
    used = {name for want in wants.values() for name in want.source.names}
    unexpected = sorted(set(entries) - used - set(tie_targets(model)))
    if unexpected:
        log.warning(f"checkpoint tensors not used by {type(model).__name__}: {', '.join(unexpected[:8])}")

    install(model, resolution, tensors, topology)
    if topology.rtp_size > 1:
        bitsandbytes.step_on_rows()  # its optimizers' state of rotated rows
        torchao.step_on_rows()
    if quantized:
        bitsandbytes.swap_modules(model, quantized, quantization, stored=stored_quantization is not None)
    if fresh:
        initialise_head(model, fresh, dtype, topology.device, topology.control)
    if model.can_generate():
        model.generation_config = options.generation_config or _generation_config(directory, model)
    load_like = functools.partial(
        from_pretrained,
        device=settings.device,
        device_mesh=device_mesh,
        rtp_size=topology.rtp_size,
        plan=plan,
        timeout=settings.timeout,
        rotation_piece_size=settings.piece_bytes,
        fused_loss=settings.fused_loss,
        verify_weights=settings.verify_weights,
        reduce_dtype=settings.reduce_dtype,
        rotation_moves=settings.rotation_moves,
    )
    bind(model, RTPState(topology, plan, resolution, sources, load_like))
    if is_causal_lm(model):
        install_forward(model, fused=settings.fused_loss and topology.rtp_size > 1)
    log.info(
        f"Loaded {type(model).__name__} with plan '{plan.name}' on {topology.world_size} rank(s)"
        + (f" as {topology.dp_size} replicas of {topology.rtp_size}-rank rings" if topology.dp_size > 1 else "")
        + ": "
        f"{len(resolution.rotated)} rotated modules, {len(resolution.replicated)} replicated parameters"
    )
    model.eval()  # as transformers' from_pretrained does
    if options.output_loading_info:
        info = {"missing_keys": set(fresh), "unexpected_keys": set(unexpected), "mismatched_keys": set()}
        return model, {**info, "error_msgs": []}  # vanilla's pair, on request
    return model


def _resolve(path, subfolder: str, revision, token, cache_dir, local_files_only, group) -> tuple[str, str | None]:
    """The folder to read, with vanilla's `subfolder` inside it (config and weights alike), and its commit."""
    path = os.fspath(path)
    if subfolder and os.path.isdir(path):
        path = os.path.join(path, subfolder)
    directory, commit = resolve_directory(path, revision, token, cache_dir, local_files_only, group)
    if subfolder and commit is not None:  # a Hub snapshot: its subfolder came with it
        directory = os.path.join(directory, subfolder)
        if not os.path.exists(os.path.join(directory, "config.json")):
            raise CheckpointError(f"{path} has no config.json in subfolder '{subfolder}'")
    if os.path.exists(os.path.join(directory, "adapter_config.json")):
        raise CheckpointError(
            f"{directory} holds a PEFT adapter (adapter_config.json) beside the base weights. Vanilla from_pretrained "
            "would apply it; hf_rtp does not apply adapters at load, and will not load the base without it silently. "
            "Merge it with vanilla (PeftModel.from_pretrained(base, path).merge_and_unload().save_pretrained(out)) "
            "and load `out`, or keep the adapter in a folder of its own"
        )
    return directory, commit


def _config(directory: str, options: keywords.LoadOptions):
    """config.json with the overrides, or the `config=` passed (a copy, as vanilla takes one)."""
    source = options.config if options.config is not None else directory
    if not isinstance(source, (str, os.PathLike)):
        return copy.deepcopy(source)
    config, unused = AutoConfig.from_pretrained(source, return_unused_kwargs=True, **options.config_kwargs)
    if unused:
        raise KeywordError(f"from_pretrained() got unexpected keyword arguments: {', '.join(sorted(unused))}")
    return config


def _refuse_quantized(config) -> None:
    """A checkpoint saved quantized (a `quantization_config` in its config.json: GPTQ, AWQ, FP8, bitsandbytes,
    ...) holds packed integers or scaled floats that mean nothing without the method's scales and kernels.
    Read as plain weights they would load without an error (an FP8 checkpoint did, its scales ignored): a
    silently different model. hf_rtp reads bitsandbytes' own 4-bit and 8-bit checkpoints as stored
    (integrations/bitsandbytes.py) and refuses every other method by name."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    raise CheckpointError(
        f"this checkpoint is quantized (its config has a quantization_config, quant_method={str(method)!r}): its "
        "weights need that method's scales and kernels, and hf_rtp reads only bitsandbytes' own 4-bit and 8-bit "
        "checkpoints, so it will not read them as plain weights. Load an unquantized (bfloat16 or float32) "
        "checkpoint of the model, with quantization_config=BitsAndBytesConfig(load_in_4bit=True) (or "
        "load_in_8bit=True) for a quantized base"
    )


class _Auto:
    """`hf_rtp.AutoModelFor....from_pretrained(path, ...)`: hf_rtp.from_pretrained with that auto class."""

    auto_class: type | None = None

    def __init__(self):
        raise KeywordError(f"{type(self).__name__} is built with {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> PreTrainedModel:
        return from_pretrained(pretrained_model_name_or_path, auto_class=cls.auto_class, **kwargs)


class AutoModelForCausalLM(_Auto):
    auto_class = transformers.AutoModelForCausalLM


class AutoModelForSequenceClassification(_Auto):
    auto_class = transformers.AutoModelForSequenceClassification


class AutoModelForTokenClassification(_Auto):
    auto_class = transformers.AutoModelForTokenClassification


class AutoModelForImageTextToText(_Auto):
    auto_class = transformers.AutoModelForImageTextToText


def bind(model: nn.Module, state: RTPState) -> nn.Module:
    """Everything hf_rtp attaches to a loaded model: its state, the collective save/push/generate, the
    DDP ignore list (and adoption of a plain Accelerator that wraps it in DDP), Trainer adoption on `.to()`, and
    the guard that makes ranks meet at each forward."""
    object.__setattr__(model, ATTRIBUTE, state)  # not a submodule, not in state_dict
    _attach(model, "save_pretrained", _save_pretrained)
    _attach(model, "push_to_hub", push_to_hub)
    _attach(model, "resize_token_embeddings", resize_token_embeddings)
    if is_causal_lm(model):
        _attach(model, "generate", generate)
    if getattr(model, "is_quantized", False):
        _attach(model, "dequantize", _refuse_dequantize)
    # DDP reads the names to ignore while a plain Accelerator's prepare wraps the model: adopt that Accelerator
    ignore_rotated_in_ddp(model, on_read=lambda: adopt_accelerator(model))

    def _apply(self, fn, recurse=True):  # every Trainer moves its model to a device in __init__
        adopt_caller(self)
        applied = type(self)._apply(self, fn, recurse)
        keep_rotated(self)
        return applied

    _attach(model, "_apply", _apply)
    if state.topology.world_size > 1:
        _attach(model, "compile", _refuse_compile)  # torch.compile(model) is refused at its first trace
        # The backbone, not the model itself: PEFT and TRL call the model's forward directly, which
        # skips the model's hooks, but every causal LM calls its backbone as a module.
        backbone = getattr(model, "base_model", None) or model
        backbone.register_forward_pre_hook(
            lambda module, args, kwargs: _before_forward(state, args, kwargs), with_kwargs=True
        )
        # after the model's forward (its LM head included), also when it raised: ops outside a forward move weights
        model.register_forward_hook(lambda *_: traffic.clear(state.topology.ring), always_call=True)
        install_when_peft_is_imported()  # process-wide, until PEFT knows the `rtp` mesh
    return model


def _attach(model: nn.Module, name: str, function) -> None:
    """`function` as `model`'s own method `name`, on this instance only (the class is untouched)."""
    setattr(model, name, types.MethodType(function, model))


def _refuse_dequantize(model, *args, **kwargs):
    raise RotatedStateError(
        "dequantize() of a rotated 4-bit or 8-bit base is not supported: transformers' dequantize replaces "
        "bitsandbytes' own modules, and each rank holds only its rows of hf_rtp's. Load the checkpoint without "
        "quantization_config for float weights, or train adapters on the quantized base"
    )


def _refuse_compile(model, *args, **kwargs):
    raise RotatedStateError(COMPILE_REFUSED)


def _save_pretrained(model, *args, **kwargs):
    """checkpoint.save.save_pretrained, refused when an unattached Trainer calls it from its main process only."""
    refuse_unattached_save(model.__dict__[ATTRIBUTE].topology.world_size)
    return save_pretrained(model, *args, **kwargs)


def _before_forward(state: RTPState, args: tuple, kwargs: dict) -> None:
    # An Accelerator built after from_pretrained can still have come up undistributed: its prepare
    # never tells us, its first forward does. A dict lookup when accelerate is not in use.
    check_accelerate_state(state.topology.world_size)
    check_attached()  # a Trainer that never placed the model is attached here, before it saves
    faults.point("forward")
    ring = state.topology.ring
    # the meeting also settles what this forward's rotated ops move (model.traffic)
    traffic.agree(ring, state.topology.enter("forward", traffic.payload(ring, args, kwargs)))


def _generation_config(directory: str, model):
    """The checkpoint's generation_config.json, as vanilla reads it: an optional file, so one that is not
    a regular file or not valid JSON is ignored (vanilla says so at info level; here it is a warning)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.lexists(path):
        return model.generation_config
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise OSError("it is not a regular file")
        return GenerationConfig.from_pretrained(directory)
    except (OSError, ValueError) as err:
        log.warning(f"ignoring {path} ({str(err).splitlines()[0][:200]}); generation uses defaults from config.json")
        return model.generation_config


def _named_plan(plan) -> plans.Plan | str:
    """A Plan, or "auto" (whose rules depend on the model): what ranks compare before loading."""
    if isinstance(plan, str) and plan != "auto":
        return plans.get(plan)
    if isinstance(plan, plans.Plan) or plan == "auto":
        return plan
    raise KeywordError(f"plan must be a Plan, a registered model_type or 'auto', got {type(plan).__name__}")


def _choose_plan(plan, model) -> plans.Plan:
    return auto_plan(model) if plan == "auto" else plan


def _resolve_dtype(dtype: Any, config, entries) -> torch.dtype:
    """As vanilla: "auto" is config.dtype, else the first floating dtype of the first weight file."""
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or _stored_dtype(entries)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise SettingError(f"dtype must be 'auto' or a torch dtype such as 'bfloat16', got {dtype!r}")
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise SettingError(
            f"dtype must be 'auto', None, a torch dtype or a dict of them by sub-config, got {type(dtype).__name__}"
        )
    return dtype


def _refuse_remote_code(directory: str, options: keywords.LoadOptions, auto_class) -> None:
    """trust_remote_code=True: vanilla runs the checkpoint's own code where its config maps the config class or
    the model's auto class to it (`auto_map`); elsewhere it builds transformers' own class, as hf_rtp does."""
    if not options.trust_remote_code:
        return
    source = options.config if options.config is not None else directory
    if isinstance(source, (str, os.PathLike)):
        mapped = PreTrainedConfig.get_config_dict(source)[0].get("auto_map") or {}
    else:
        mapped = getattr(source, "auto_map", None) or {}
    wanted = getattr(auto_class, "__name__", None) or "AutoModelForCausalLM"
    remote = sorted(name for name in mapped if name in ("AutoConfig", wanted))
    if remote:
        raise KeywordError(
            f"hf_rtp.from_pretrained does not take trust_remote_code=True for this checkpoint: its config.json maps "
            f"{', '.join(remote)} to the repository's own code ({', '.join(str(mapped[n]) for n in remote)}), which "
            "vanilla would run. hf_rtp rotates transformers' own model classes only; a checkpoint of a built-in "
            "architecture loads with trust_remote_code=True as in vanilla"
        )


def _keep_float32(model, dtype: torch.dtype) -> None:
    """The parameters vanilla's load keeps in float32 (a class's `_keep_in_fp32_modules(_strict)`, e.g.
    DeepSeek-V3's router) made float32 in the empty model; each parameter is then read in its own dtype
    (checkpoint/load.py), which also keeps a class's explicit dtypes (a router created float32), as vanilla's."""
    patterns = [re.compile(p.replace("*", ".*")) for p in float32_patterns(model, dtype)]
    for name, param in model.named_parameters():
        if any(p.search(name) for p in patterns):
            param.data = param.data.to(torch.float32)


def _stored_dtype(entries) -> torch.dtype:
    first = min((e.path for e in entries.values()), default=None)
    stored = [entries[n].dtype for n in sorted(entries) if entries[n].path == first]
    floating = [d for d in stored if d.is_floating_point and "float8" not in str(d)]
    return (floating or stored or [torch.float32])[0]
