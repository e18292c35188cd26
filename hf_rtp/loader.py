"""from_pretrained's steps, in the order it runs them: start, resolve, recover, agree, build, read, install.

Each step is collective where it says so; a failure on one rank is an error on every rank (agreed). The
quantization of a load, whatever it is, is one object the steps call (checkpoint.quantized.QuantizedLoad).
"""

from __future__ import annotations

import copy
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig, PreTrainedModel

from . import faults, keywords, log, plans
from .checkpoint.files import find_weights, require_config, resolve_directory
from .checkpoint.fingerprint import agree, fingerprint
from .checkpoint.keys import untie_stored_apart, wants_for
from .checkpoint.load import read_proven
from .checkpoint.quantized import QuantizedLoad
from .checkpoint.safetensors_io import TensorEntry
from .distributed.ranks.agreement import agreed
from .distributed.ranks.topology import Topology, setup
from .errors import CheckpointError, KeywordError, SettingError, TopologyError
from .folders.commit import recover_before_reading
from .integrations import bitsandbytes, torchao
from .integrations.accelerate import adopt_built_accelerators, check_accelerate_state
from .model.heads import fresh_head, initialise_head
from .model.install import install
from .model.step_check import check_steps
from .model.ties import tie_targets
from .plans.auto import auto_plan
from .private.transformers_names import float32_patterns
from .settings import Settings


@dataclass
class Source:
    """What a load reads: the folder, the Hub commit it came from (None: a local folder), its config (with the
    user's overrides and the quantization it records), its quantization, and the weight files' tensors."""

    directory: str
    commit: str | None
    config: Any
    quantization: QuantizedLoad
    entries: dict[str, TensorEntry] = field(default_factory=dict)


@dataclass
class Read:
    """What the read step gives the install step: this rank's tensors (or rows, or quantized pieces), the stored
    names each parameter came from, a head the checkpoint lacked (initialised fresh) and tensors no module used."""

    tensors: dict[str, torch.Tensor]
    sources: dict
    fresh: list[str]
    unexpected: list[str]


def start(settings: Settings, device_mesh: DeviceMesh | None, rtp_size: int | None) -> Topology:
    """Collective: the process group and the rings; a misspelt fault point or an Accelerator that runs
    undistributed fails here, before anything is read."""
    topology = setup(settings, device_mesh, rtp_size)
    with agreed(topology.control, TopologyError):
        faults.check()  # a misspelt fault point is an error, not a test that injects nothing
    check_accelerate_state(topology.world_size)
    adopt_built_accelerators()
    return topology


def resolve(path, options: keywords.LoadOptions, hub: dict, auto_class, topology: Topology) -> Source:
    """Collective: the folder to read (a Hub id downloaded once per node, `hub` holding revision, token, cache_dir
    and local_files_only), a save a crash interrupted there finished (`recover`), the config with the user's
    overrides, and the load's quantization. The weight files' tensors come next (`find`)."""
    directory, commit = _folder(path, options.subfolder, hub, topology.control)
    if commit is None:  # a local folder: one hf_rtp may have been saving into when a crash hit
        recover(directory, topology)
        require_config(directory)  # after recovery: a first save a crash interrupted may not have moved it in yet
    _refuse_remote_code(directory, options, auto_class)  # before the config is built: that may be remote code too
    config = _config(directory, options)
    quantization = bitsandbytes.quantized_load(config, options.quantization_config)
    return Source(directory, commit, config, quantization)


def recover(directory: str, topology: Topology) -> None:
    """The load's recovery step, named (folders/commit.py): rank 0 finishes a save_pretrained a crash interrupted
    in `directory`, when the folder provably holds what the crash left, so that no rank reads a mix."""
    recover_before_reading(directory, topology.control)


def find(source: Source, options: keywords.LoadOptions, topology: Topology) -> torch.dtype:
    """Collective: the weight files' tensors (into `source.entries`) and the dtype to load in (options.dtype)."""
    with agreed(topology.control, CheckpointError):  # one rank's bad file is everyone's error
        source.entries = find_weights(source.directory, options.variant).tensors()
    dtype = _resolve_dtype(options.dtype, source.config, source.entries)
    source.config.dtype = dtype  # as vanilla records it
    return dtype


def agree_on_checkpoint(
    source: Source, plan: plans.Plan | str, settings: Settings, dtype: torch.dtype, auto_class, topology: Topology
) -> None:
    """Collective, before any other: every rank loads the same checkpoint, config, plan and settings (ranks
    holding other files would otherwise meet in different collectives)."""
    agree(
        fingerprint(
            commit=source.commit,
            config=source.config,
            entries=source.entries,
            plan=plan,
            piece_bytes=settings.piece_bytes,
            dtype=dtype,
            verify=settings.verify_weights,
            model_class=auto_class.__name__,
            reduce_dtype=settings.reduce_dtype,
            tiled_mlp=settings.tiled_mlp,  # tiled and whole MLPs walk the ring a different number of times
        ),
        topology.control,
    )


def named_plan(plan, config) -> plans.Plan | str:
    """A Plan, or "auto" (whose rules depend on the model): what ranks compare before loading. None: the plan
    registered for config.model_type (an unknown architecture fails here, early)."""
    if plan is None:
        return plans.get(config.model_type)
    if isinstance(plan, str) and plan != "auto":
        return plans.get(plan)
    if isinstance(plan, plans.Plan) or plan == "auto":
        return plan
    raise KeywordError(f"plan must be a Plan, a registered model_type or 'auto', got {type(plan).__name__}")


def build(auto_class, source: Source, dtype: torch.dtype, plan: plans.Plan | str, topology: Topology):
    """The empty model (parameters on meta, buffers such as rotary tables computed for real), the plan that
    fits it and what it rotates, and the modules its quantization takes."""
    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(source.config, dtype=dtype)
    _keep_float32(model, dtype)
    untie_stored_apart(model, source.entries, topology)
    chosen = auto_plan(model) if plan == "auto" else plan
    assert isinstance(chosen, plans.Plan)
    resolution = chosen.resolve(model)
    source.quantization.plan(model, resolution, dtype, topology.rtp_size)
    return model, chosen, resolution


def read(model, resolution, source: Source, dtype: torch.dtype, settings: Settings, topology: Topology) -> Read:
    """Collective: this rank's rows of every rotated tensor and every replicated tensor whole, once the ranks
    proved they read one checkpoint's bytes; a head the checkpoint lacks is left for `install` to initialise."""
    entries = source.entries
    with agreed(topology.control, CheckpointError):  # file reads: one rank's failure is every rank's error
        wants, sources = wants_for(model, resolution, topology, entries)
    lacking = sorted(n for n, want in wants.items() if any(name not in entries for name in want.source.names))
    fresh = fresh_head(model, lacking, resolution.rotated_params)
    for name in fresh:
        del wants[name], sources[name]
    with agreed(topology.control, CheckpointError):
        transforms = source.quantization.transforms(model, wants, entries)
    tensors = read_proven(entries, wants, dtype, topology, settings.verify_weights, transforms=transforms)
    source.quantization.finish(model, tensors, topology)
    used = {name for want in wants.values() for name in want.source.names}
    unexpected = sorted(set(entries) - used - set(tie_targets(model)))
    if unexpected:
        log.warning(f"checkpoint tensors not used by {type(model).__name__}: {', '.join(unexpected[:8])}")
    return Read(tensors, sources, fresh, unexpected)


def install_weights(
    model, resolution, read: Read, source: Source, dtype: torch.dtype, options, topology: Topology
) -> None:
    """The tensors read become the model's parameters (rotated ones as DTensors of this rank's rows); the
    quantized modules, a fresh head and the generation config follow, as vanilla's model has them."""
    install(model, resolution, read.tensors, topology)
    if topology.world_size > 1:  # first of the step pre-hooks: a step it refuses has stepped no row
        check_steps()
    if topology.rtp_size > 1:
        bitsandbytes.step_on_rows()  # its optimizers' state of rotated rows
        torchao.step_on_rows()
    source.quantization.install(model)
    if read.fresh:
        initialise_head(model, read.fresh, dtype, topology.device, topology.control)
    if model.can_generate():
        model.generation_config = options.generation_config or _generation_config(source.directory, model)


def _folder(path, subfolder: str, hub: dict, group) -> tuple[str, str | None]:
    """The folder to read, with vanilla's `subfolder` inside it (config and weights alike), and its commit."""
    path = os.fspath(path)
    if subfolder and os.path.isdir(path):
        if not os.path.isdir(os.path.join(path, subfolder)):  # not a Hub id to download: vanilla's OSError too
            raise CheckpointError(f"{path} has no subfolder '{subfolder}' (subfolder=) holding a config.json")
        path = os.path.join(path, subfolder)
    directory, commit = resolve_directory(
        path, hub["revision"], hub["token"], hub["cache_dir"], hub["local_files_only"], group
    )
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


def _keep_float32(model: nn.Module, dtype: torch.dtype) -> None:
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


def loaded(model: PreTrainedModel, plan: plans.Plan, resolution, read: Read, options, topology: Topology):
    """The last step: the log line, eval mode as transformers' from_pretrained leaves it, and vanilla's
    (model, loading info) pair when output_loading_info=True."""
    log.info(
        f"Loaded {type(model).__name__} with plan '{plan.name}' on {topology.world_size} rank(s)"
        + (f" as {topology.dp_size} replicas of {topology.rtp_size}-rank rings" if topology.dp_size > 1 else "")
        + ": "
        f"{len(resolution.rotated)} rotated modules, {len(resolution.replicated)} replicated parameters"
    )
    model.eval()  # as transformers' from_pretrained does
    if options.output_loading_info:
        info = {"missing_keys": set(read.fresh), "unexpected_keys": set(read.unexpected), "mismatched_keys": set()}
        return model, {**info, "error_msgs": []}  # vanilla's pair, on request
    return model
