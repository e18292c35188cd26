"""What hf_rtp.from_pretrained does with each keyword transformers' `from_pretrained` takes.

Each is honoured with vanilla's meaning (by from_pretrained itself, or resolved here), a no-op exactly as
it is in vanilla, or refused by name with the reason and what to do instead. None reaches a place that
would silently ignore it: config overrides alone go on to the config, as in vanilla.
`tests/unit/test_from_pretrained_keywords.py` walks vanilla's signature and the keywords its body reads,
and fails on one this table does not decide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from . import log
from .errors import KeywordError, SettingError

# vanilla pops and drops these itself ("not used anymore", internal markers of the Auto classes)
NO_OPS = ("low_cpu_mem_usage", "mirror", "_fast_init", "from_tf", "from_flax", "offload_state_dict", "_commit_hash")
NO_OPS_INTERNAL = ("_from_auto", "_from_pipeline")

_KERNELS = "Hub kernels replace module forwards, and hf_rtp has replaced those modules with rotated layers"
_SPLIT = "splits or offloads the model across devices; hf_rtp splits it across ranks instead"
_TP = (
    "transformers' tensor parallelism splits the same weights hf_rtp rotates: use one of the two "
    "(hf_rtp.from_pretrained without it, or transformers' from_pretrained with it)"
)

# keyword -> why hf_rtp refuses it (any value but vanilla's default), and what to do instead
REFUSED = {
    "state_dict": "hf_rtp reads each rank's rows from safetensors files and never holds a whole model: "
    "save the state dict (save_pretrained) and load that folder",
    "max_memory": f"it {_SPLIT}: pass device= (default: this rank's LOCAL_RANK GPU, else CPU)",
    "offload_folder": f"it {_SPLIT}: pass device= (default: this rank's LOCAL_RANK GPU, else CPU)",
    "offload_buffers": f"it {_SPLIT}: pass device= (default: this rank's LOCAL_RANK GPU, else CPU)",
    "tp_plan": _TP,
    "tp_size": _TP,
    "distributed_config": _TP,
    "gguf_file": "hf_rtp reads safetensors only: convert the GGUF file with transformers and save_pretrained",
    "key_mapping": "hf_rtp maps checkpoint names itself (see plans): rename the checkpoint's tensors with "
    "transformers' from_pretrained(key_mapping=...) and save_pretrained, then load that folder",
    "use_kernels": _KERNELS,
    "kernel_config": _KERNELS,
    "allow_all_kernels": _KERNELS,
    "fusion_config": "fusing modules at load would replace the modules hf_rtp rotates",
    "tqdm_class": "hf_rtp shows its own progress bars (on rank 0)",
    "proxies": "set HTTPS_PROXY in the environment, which huggingface_hub reads",
    "force_download": "hf_rtp downloads the revision once and every rank reads that commit: delete it from the "
    "cache, or pass revision=",
    "ignore_mismatched_sizes": "hf_rtp does not re-initialise tensors whose shape differs from the config yet: "
    "load the checkpoint with vanilla, replace the mismatched module, save_pretrained, and load that",
    "adapter_name": "hf_rtp does not apply PEFT adapters at load",
    "adapter_kwargs": "hf_rtp does not apply PEFT adapters at load",
}
# vanilla's defaults of the refused keywords that have one besides None: passing those is not a request
_DEFAULTS: dict[str, Any] = {
    "offload_buffers": False,
    "use_kernels": False,
    "allow_all_kernels": False,
    "force_download": False,
    "ignore_mismatched_sizes": False,
    "adapter_name": "default",
}

# honoured by from_pretrained's own parameters, or below
HONOURED = (
    "config",
    "cache_dir",
    "local_files_only",
    "token",
    "revision",
    "use_safetensors",
    "weights_only",
    "disable_mmap",
    "output_loading_info",
    "dtype",
    "torch_dtype",
    "device_map",
    "subfolder",
    "variant",
    "generation_config",
    "quantization_config",  # bitsandbytes 4/8-bit (integrations/bitsandbytes.py); others refused by name
    "trust_remote_code",  # a built-in architecture loads as in vanilla; refused where remote code would run (loader.py)
    "device_mesh",  # hf_rtp's own: the ranks to rotate on (transformers': its tensor-parallel mesh)
    "attn_implementation",  # config overrides, passed on to the config as vanilla does
    "experts_implementation",
)


@dataclass
class LoadOptions:
    """The vanilla keywords from_pretrained acts on, after refusals."""

    config: Any = None
    subfolder: str = ""
    variant: str | None = None
    output_loading_info: bool = False
    generation_config: Any = None
    quantization_config: Any = None
    dtype: Any = "auto"
    device: Any = None
    trust_remote_code: bool = False
    config_kwargs: dict = field(default_factory=dict)


def resolve(kwargs: dict, dtype, device) -> LoadOptions:
    """Sort the keywords a user passed: refuse, drop (vanilla's no-ops) or take each; the rest are config overrides."""
    kwargs = dict(kwargs)
    for name in NO_OPS + NO_OPS_INTERNAL:
        kwargs.pop(name, None)
    for name, reason in REFUSED.items():
        if name in kwargs and kwargs[name] != _DEFAULTS.get(name):
            raise KeywordError(f"hf_rtp.from_pretrained does not take {name}=: {reason}")
        kwargs.pop(name, None)
    if kwargs.pop("use_safetensors", None) is False:
        raise KeywordError("hf_rtp.from_pretrained does not take use_safetensors=False: it reads safetensors only")
    if kwargs.pop("weights_only", True) is not True:
        raise KeywordError("hf_rtp.from_pretrained does not take weights_only=False: it never unpickles weights")
    kwargs.pop("disable_mmap", None)  # hf_rtp reads each rank's rows with plain reads, never through a mapping
    torch_dtype = kwargs.pop("torch_dtype", None)
    options = LoadOptions(
        config=kwargs.pop("config", None),
        subfolder=kwargs.pop("subfolder", "") or "",
        variant=kwargs.pop("variant", None),
        output_loading_info=bool(kwargs.pop("output_loading_info", False)),
        generation_config=kwargs.pop("generation_config", None),
        quantization_config=_quantization(kwargs.pop("quantization_config", None)),
        # vanilla's older name: a dtype given wins, but "auto" (or None) yields to it through the Auto classes
        dtype=_main_dtype(torch_dtype if torch_dtype is not None and _is_auto(dtype) else dtype),
        device=_device_from_map(kwargs.pop("device_map", None), device),
        trust_remote_code=bool(kwargs.pop("trust_remote_code", False)),
    )
    if options.config is not None and not isinstance(options.config, (str, os.PathLike)) and kwargs:
        raise KeywordError(
            f"from_pretrained(config=<a config object>) got config overrides {', '.join(sorted(kwargs))}: "
            "set them on the config you pass"
        )
    options.config_kwargs = kwargs
    return options


def _is_auto(dtype) -> bool:
    return dtype is None or (isinstance(dtype, str) and dtype == "auto")


def _main_dtype(dtype):
    """Vanilla's meaning of `dtype`: None is "auto" (transformers 5's default); a dict of per-sub-config dtypes is
    its "" entry (else torch's default dtype) for every module, with vanilla's warning (transformers 5.23 and 5.24
    set that one dtype on the config and every sub-config)."""
    if dtype is None:
        return "auto"
    if not isinstance(dtype, dict):
        return dtype
    main = dtype.get("", torch.get_default_dtype())
    if isinstance(main, str):
        if not isinstance(getattr(torch, main, None), torch.dtype):
            raise SettingError(f"dtype={dtype!r}: its '' entry must name a torch dtype such as 'bfloat16'")
        main = getattr(torch, main)
    if not isinstance(main, torch.dtype):
        raise SettingError(f"dtype={dtype!r}: its '' entry must be a torch dtype, not {type(main).__name__}")
    log.warning(
        "Using different dtypes per module is deprecated and will be removed in future versions Setting different "
        f"dtypes per backbone model might cause device errors downstream, therefore setting the dtype={main} for all "
        "modules."
    )
    return main


def _quantization(config):
    if config is None:
        return None
    from .integrations.bitsandbytes import checked_config

    return checked_config(config)


def _device_from_map(device_map, device):
    """A device_map that places the whole model on one device (`{"": local_rank}`, the DDP and QLoRA idiom;
    "cpu"; an index or device) is that device; one that splits the model is refused."""
    if device_map is None:
        return device
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise KeywordError(
                f"hf_rtp.from_pretrained does not take device_map={device_map!r}: it {_SPLIT}. "
                'Pass device_map={"": local_rank} (the whole model on this rank\'s device) or device='
            )
        device_map = device_map[""]
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise KeywordError(
            f"hf_rtp.from_pretrained does not take device_map={device_map!r}: it {_SPLIT}. "
            "Leave device_map out (each rank uses its LOCAL_RANK GPU, else CPU), or pass device="
        )
    placed = torch.device("cuda", device_map) if isinstance(device_map, int) else torch.device(device_map)
    if device is not None and torch.device(device) != placed:
        raise KeywordError(f"device={device!r} and device_map={device_map!r} place the model on different devices")
    return placed
