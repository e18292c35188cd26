"""Per-rank training memory from config.json alone: DDP, FSDP2, transformers TP and RTP.

    hf-rtp estimate ./my-model --world-size 4 --batch 2 --seq 128

Nothing is read but the config: the model is built on the meta device, which gives every
parameter's shape, hf_rtp's plan (what rotates, chunk and piece sizes), transformers' tp_plan, and,
by running one forward on meta tensors, the bytes autograd saves for backward.

Each strategy's peak is the larger of two moments of a training step:
  backward: parameters and optimizer state, the saved activations, and the gradient of the logits
            (plus what the strategy keeps unsharded);
  optimizer step: parameters, gradients and optimizer state, plus two temporaries the size of the
            largest local parameter (AdamW's per-tensor arithmetic);
plus what the device holds beyond those tensors (`DeviceTerms`: `CPU` or `CUDA`). RTP's estimate is for the
fused LM-head loss (its default, no logits kept; its tile is the device's, as `layers/fused_loss.py` picks it);
`rtp-unfused` is for fused_loss=False. The terms and constants were set against `hf-rtp bench` on the 90M Llama
preset (batch 2x128) and the 128k-vocabulary one (1x1024), on this project's CPU machine, and checked at shapes not
used to set them (tests/unit/test_memory_estimate.py, against benchmarks/results); they are an estimate, not a
bound. On CUDA the tensors are counted alike; what a CUDA process holds beside them (its context, cuBLAS's
workspaces, NCCL's buffers, the caching allocator's segments) comes from the sources `CUDA` names, not from a
measurement here.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers.fused_loss import ACCELERATOR_BLOCK_BYTES, BLOCK_BYTES
from ..model import tiled_mlp as tiled_mlp_module
from ..private.transformers_names import attention_implementation, no_split_modules, set_attention_implementation

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
RUNTIME_BYTES = 35e6  # allocator slack, autograd graph, index tensors: measured beside the tensors on CPU
STRATEGIES = ("single", "ddp", "fsdp2", "tp", "rtp")
MiB = 2**20


@dataclass(frozen=True)
class DeviceTerms:
    """What a rank's device adds to the tensors the estimate counts."""

    name: str
    loss_tile: int
    """bytes of float32 logits one tile of the fused loss holds (layers/fused_loss.py's block_bytes)"""
    in_allocator: float
    """held through the framework's allocator beyond the counted tensors, per process (on CUDA this shows in
    torch.cuda.max_memory_allocated and _reserved)"""
    context: float = 0.0
    """held outside the allocator, per process (the CUDA context: nvidia-smi shows it, torch's counters do not)"""
    per_group: float = 0.0
    """held outside the allocator per process group that carries this device's tensors (NCCL's buffers)"""


CPU = DeviceTerms("cpu", BLOCK_BYTES, RUNTIME_BYTES)
"""Host memory, as `hf-rtp bench` measures it on a CPU (VmRSS): the 35 MB were measured there, with the tensors."""

# What a CUDA process holds beside its tensors. Each figure is an estimate from the source named, not measured by
# this project (its CI has no GPU); .ci/gpu's bench prints max_memory_allocated and max_memory_reserved beside it.
CUDA_CONTEXT_BYTES = 500e6
"""The CUDA context and the kernels loaded into it: 287 MB just after creation with lazy module loading (pytorch
#86509, CUDA 11.7), about 400 MB (pytorch #109888), 426 MiB for torch 2.10 with CUDA 13.0 on an RTX 6000 Ada
(unsloth-zoo #1053); rounded up for the kernels a training step loads lazily (cuBLAS, attention, the optimizer)."""
CUBLAS_WORKSPACE_BYTES = 4 * 32 * MiB
"""torch keeps one cuBLAS workspace per handle and stream, from its caching allocator (pytorch's
CublasHandlePool.cpp), and a thread gets its own handles: the forward's thread and autograd's backward thread,
each with a cuBLAS and a cuBLASLt handle, at the 32 MiB cuBLAS recommends on Hopper (cublasSetWorkspace's docs;
4 MiB before Hopper). An upper figure for H100 and H200."""
ALLOCATOR_SEGMENT_BYTES = 2 * (20 + 2) * MiB
"""torch's caching allocator holds memory in segments: requests of 1 to 10 MiB share 20 MiB segments, smaller ones
2 MiB segments, larger ones are rounded up to 2 MiB (kLargeBuffer, kSmallBuffer, kRoundLarge in
c10/cuda/CUDACachingAllocator.cpp), per stream: one partly used segment of each kind on the compute stream and on
a communication stream. A training loop that repeats its shapes reuses its blocks (torch's CUDA semantics notes,
expandable_segments); fragmentation beyond that, as when shapes change from step to step, is not estimated
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True keeps it small)."""
NCCL_CONNECTION_BYTES = 4 * MiB + 4_915_200 + 524_288
"""NCCL's buffers for one connection on one channel: its SIMPLE protocol's NCCL_BUFFSIZE (4 MiB, NCCL's env.rst),
LL128's and LL's defaults (DEFAULT_LL128_BUFFSIZE and DEFAULT_LL_BUFFSIZE in NCCL 2.30's src/init.cc); NVIDIA/nccl
#1685 saw NCCL allocate 10 MiB per connection and channel between H100s."""
NCCL_CHANNELS = 16
"""Channels of one communicator between NVLink GPUs (NCCL picks by topology: a few over PCIe, up to 32 on H100
NVLink); its memory grows linearly with them (NVIDIA/nccl #864, #986). An assumption, not a reading."""
NCCL_GROUP_BYTES = 2 * NCCL_CHANNELS * NCCL_CONNECTION_BYTES
"""One communicator that carries CUDA tensors: a connection to the previous and the next rank per channel, as
a ring (or the ring's point-to-point sends) uses them; about 0.31 GB."""
CUDA = DeviceTerms(
    "cuda",
    ACCELERATOR_BLOCK_BYTES,
    CUBLAS_WORKSPACE_BYTES + ALLOCATOR_SEGMENT_BYTES,
    context=CUDA_CONTEXT_BYTES,
    per_group=NCCL_GROUP_BYTES,
)
DEVICES = {"cpu": CPU, "cuda": CUDA}
# Process groups whose collectives carry a strategy's CUDA tensors, each its own NCCL communicator: DDP's, FSDP2's
# and TP's world; RTP's ring (point to point) and its mesh (replicated gradients, DTensor ops); HSDP's shard and
# replicate groups. Rings of K with replicas add the replicas' group (`_groups`).
GROUPS = {
    "single": 0,
    "ddp": 1,
    "fsdp2": 1,
    "tp": 1,
    "rtp": 2,
    "rtp-unfused": 2,
    "rtp-cp": 2,
    "hsdp": 2,
    "rtp-offload": 2,
}


def device_terms(device: str) -> DeviceTerms:
    """`CPU` or `CUDA` by name ("cuda:0" counts as "cuda")."""
    kind = device.split(":")[0]
    if kind not in DEVICES:
        raise ValueError(f"the estimate knows the devices {', '.join(DEVICES)}, not {device!r}")
    return DEVICES[kind]


def outside_allocator(strategy: str, world_size: int, device: str, rtp_size: int | None = None) -> float:
    """What `estimate(..., device=device)[strategy]` counts outside the framework's allocator: the CUDA context and
    NCCL's buffers (none on a CPU). Subtract it to compare with torch.cuda.max_memory_allocated or _reserved."""
    terms = device_terms(device)
    return terms.context + _groups(strategy, world_size, rtp_size) * terms.per_group


def _groups(strategy: str, world_size: int, rtp_size: int | None) -> int:
    if world_size == 1:
        return 0  # world size 1 is plain PyTorch: no process group
    replicas = rtp_size is not None and rtp_size < world_size and strategy.startswith("rtp")
    return GROUPS.get(strategy, 1) + replicas


def load_config(model_or_config: str):
    """A folder or Hub id (config.json only), a path to a config.json, or a bench preset name."""
    from transformers import AutoConfig, LlamaConfig

    from .bench.presets import PRESETS

    if model_or_config in PRESETS and not os.path.exists(model_or_config):
        return LlamaConfig(**PRESETS[model_or_config])
    if os.path.isfile(model_or_config):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(model_or_config)) or ".")
    return AutoConfig.from_pretrained(model_or_config)


def config_from(args: argparse.Namespace):
    """The config `hf-rtp estimate` is asked about: --model, with --attn-implementation if given. A model whose
    config cannot be read ends the command with one line that says why (SystemExit), not a traceback."""
    try:
        config = load_config(args.model)
    except (OSError, ValueError) as err:
        raise SystemExit(f"hf-rtp estimate: {unreadable(args.model, err)}") from None
    if args.attn_implementation:
        set_attention_implementation(config, args.attn_implementation)
    return config


def unreadable(name: str, err: Exception) -> str:
    """Why `load_config(name)` failed, in one line: a missing path, a Hub id while offline (HF_HUB_OFFLINE), a
    folder without config.json, or what transformers said (its first line)."""
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    said = next(iter(str(err).strip().splitlines()), "") or type(err).__name__
    if os.path.isdir(name):
        return f"{name} is a folder, but its config.json could not be read: {said}"
    if os.path.exists(name):
        return f"{name} could not be read as a config.json: {said}"
    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"{name}: no such folder or file (and not a Hub id or a bench preset)"
    if huggingface_hub.is_offline_mode():
        return (
            f"{name} is not a local folder or a bench preset, and as a Hub id its config.json is not in the local "
            f"cache while HF_HUB_OFFLINE is set: download it first (hf download {name} config.json) or pass a "
            "local folder"
        )
    return f"{name} is not a local folder or a bench preset; its config.json could not be fetched from the Hub: {said}"


def _meta_model(config, dtype: torch.dtype) -> Any:  # a transformers model on meta
    from transformers import AutoModelForCausalLM

    # from_config sets config.dtype to `dtype`: on the caller's config, a later "auto" would read this call's dtype
    config = copy.deepcopy(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# The names a dtype goes by where transformers users type one: torch's (from_pretrained(dtype="bfloat16"), config.json),
# torch's aliases (half, float, double) and TrainingArguments' flags (--bf16, --fp16), each the weights' dtype.
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}
DTYPE_CHOICES = "auto (the config's dtype, as from_pretrained(dtype='auto')), " + ", ".join(DTYPES)


def _known(text: str) -> torch.dtype | None:
    return DTYPES.get(text.strip().lower().removeprefix("torch."))


def dtype_name(text: str) -> str:
    """A dtype as a user types it (`DTYPES`' names, "torch.bfloat16", any case) as torch names it: "bf16" is
    "bfloat16". An argparse type (hf-rtp bench): anything else is refused with the usage, naming the choices."""
    dtype = _known(text)
    if dtype is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype hf-rtp knows; one of {', '.join(DTYPES)}")
    return str(dtype).removeprefix("torch.")


def dtype_setting(text: str) -> str:
    """`hf-rtp estimate --dtype`: "auto" or `dtype_name`'s."""
    if text.strip().lower() == "auto":
        return "auto"
    if _known(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype hf-rtp knows; one of {DTYPE_CHOICES}")
    return dtype_name(text)


def resolve_dtype(dtype: str | torch.dtype, config=None) -> tuple[torch.dtype, str]:
    """(the weights' dtype, where it comes from). "auto" is the config's `dtype` (transformers reads an older
    config's `torch_dtype` into it), as from_pretrained(dtype="auto") takes it; a config that names none is
    estimated in float32, and the second element says so: from_pretrained would read the weights' dtype then."""
    if isinstance(dtype, torch.dtype):
        return dtype, "as asked"
    if dtype.strip().lower() != "auto":
        known = _known(dtype)
        if known is None:
            raise ValueError(f"dtype {dtype!r} is not a dtype hf-rtp knows; one of {DTYPE_CHOICES}")
        return known, "as asked"
    stored = getattr(config, "dtype", None)
    if stored is None:
        return torch.float32, "the config names no dtype: pass --dtype if its weights are stored in another"
    if isinstance(stored, str):
        stored = _known(stored) or stored
    if not isinstance(stored, torch.dtype) or not stored.is_floating_point:
        raise ValueError(f"the config's dtype {stored!r} is not a floating dtype hf-rtp knows: pass --dtype")
    return stored, "the config's dtype"


def _dtype(dtype: str | torch.dtype, config=None) -> torch.dtype:
    return resolve_dtype(dtype, config)[0]


def model_states_bytes(config, dtype: str | torch.dtype = "auto", optimizer: str = "adamw") -> int:
    """Parameters + gradients + optimizer state of the whole model, on one device."""
    dtype = _dtype(dtype, config)
    model = _meta_model(config, dtype)
    params = list(model.parameters())  # tied weights once: parameters() deduplicates
    return sum(p.numel() for p in params) * dtype.itemsize * (2 + OPTIMIZER_STATES[optimizer])


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel (SDPA's flash and memory-efficient paths, flash-attention) keeps
    for backward: q, k, v, the output and one float32 log-sum-exp per query, never [seq, seq] scores.
    Traced on meta only: it computes nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def _fused_attention(module, query, key, value, attention_mask, **kwargs):
    return _FusedAttentionSaves.apply(query, key, value).transpose(1, 2), None


def saved_activation_bytes(
    model: Any, batch: int, seq: int, labels: bool = True, gradient_checkpointing: bool = False
) -> int:
    """Bytes autograd keeps for backward in one forward of `batch` x `seq` tokens, traced on meta.

    Attention as the model runs it: eager keeps its [seq, seq] scores; SDPA and flash-attention
    (transformers' defaults) keep only per-query statistics, which a meta trace of SDPA would not show.
    Without `labels` the trace stops at the head's input: no logits are kept.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers import AttentionInterface

    def key(t):
        return StorageWeakRef(t.untyped_storage()).cdata

    params = {key(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        k = key(t)
        if k not in params:
            saved[k] = max(saved.get(k, 0), t.untyped_storage().nbytes())
        return t

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    attention = attention_implementation(model.config)
    if attention != "eager":
        AttentionInterface.register("hf_rtp_fused_estimate", _fused_attention)
        set_attention_implementation(model.config, "hf_rtp_fused_estimate")
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # an explicit mask: without one, transformers looks for packed sequences with .item(), which meta cannot do
            mask = torch.ones_like(ids)
            if labels:
                model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
            else:
                model.base_model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        set_attention_implementation(model.config, attention)
        if gradient_checkpointing:
            model.activation_checkpointing_disable()
    return sum(saved.values())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules transformers itself never splits across devices (LlamaDecoderLayer, GPT2Block, ...):
    FSDP2's units in the bench, and the unsharded layer in its estimate."""
    names = set(no_split_modules(model))
    return [m for m in model.modules() if type(m).__name__ in names]


def _rtp_local(model: Any, world_size: int, itemsize: int, piece_bytes: int) -> tuple[int, int, int, int]:
    """(elements this rank holds, its largest local tensor, pool slot elements, of which an embedding's
    lookup needs) under hf_rtp's plan."""
    from .. import plans
    from ..distributed.tensors.sharding import ChunkLayout, chunk_rows
    from ..plans.auto import auto_plan

    model_type = model.config.model_type
    plan = plans.get(model_type) if model_type in plans.supported() else auto_plan(model)
    resolution = plan.resolve(model)
    by_module: dict[str, list[torch.Size]] = defaultdict(list)
    local, largest = 0, 0
    for name, p in model.named_parameters():  # tied weights once, under their first name
        if name in resolution.rotated_params and world_size > 1:
            by_module[name.rpartition(".")[0]].append(p.shape)
            start, end = chunk_rows(p.shape[0], world_size, 0)  # chunk 0 is the largest
            n = (end - start) * math.prod(p.shape[1:])
        else:
            n = p.numel()
        local, largest = local + n, max(largest, n)
    piece = lookup = 0
    for module, shapes in by_module.items():
        layout = ChunkLayout(tuple(shapes), world_size)
        numel = layout.max_piece_numel(layout.pieces_for(piece_bytes // itemsize))
        piece = max(piece, numel)
        if isinstance(model.get_submodule(module), nn.Embedding):
            lookup = max(lookup, numel)
    return local, largest, piece, lookup


def _tp_local(model: Any, world_size: int) -> int:
    """Elements a rank holds under transformers' tp_plan: planned modules' weights split N ways."""
    import fnmatch

    plan = getattr(model, "tp_plan", None) or {}
    local = 0
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatch(module, pattern)), None)
        split = style is not None and not (leaf == "bias" and style.startswith("rowwise"))
        local += math.ceil(p.numel() / world_size) if split else p.numel()
    return local


def estimate(
    config,
    world_size: int,
    *,
    batch: int = 2,
    seq: int = 128,
    dtype: str | torch.dtype = "auto",
    optimizer: str = "adamw",
    piece_bytes: int = 16 * 10**6,
    gradient_checkpointing: bool = False,
    rtp_size: int | None = None,
    autocast: bool = False,
    device: str = "cpu",
    tiled_mlp: bool | int | str = "auto",
    checkpoint_offload: bool = False,
    optimizer_offload: bool = False,
) -> dict[str, float]:
    """Estimated peak training bytes per rank for each strategy (`single` ignores world_size).

    `optimizer_offload`: adds the rows with the optimizer's state and step in host memory (memory_offload.py):
    `rtp-offload` (hf_rtp.CPUOffloadOptimizer), `fsdp2-offload` (FSDP2's CPUOffloadPolicy) and `zero3-offload`
    (DeepSpeed ZeRO-3 with offload_optimizer); `host_bytes` gives their host memory.

    `checkpoint_offload` (with `gradient_checkpointing`): the RTP rows with model/offload.py's offload, each
    checkpointed layer's input in host memory (`checkpointed_inputs` per rank) but two: the one being recomputed and
    the one coming back meanwhile.

    `tiled_mlp`: from_pretrained's setting, for the RTP rows (model/tiled_mlp.py: "auto" tiles MLP inputs of more
    than 16384 tokens per rank); the other strategies run their MLPs whole.

    `device`: "cpu" (the default: the terms `hf-rtp bench` measured on this project's CPU machine) or "cuda"
    (the fused loss's CUDA tile, and what a CUDA process holds beyond its tensors: `CUDA`). On CUDA each figure
    is the device memory one rank's process takes (what nvidia-smi shows for it); `outside_allocator` says how
    much of it torch's memory counters do not see.

    With `rtp_size` K below the world size, RTP runs as rings of K (a rank holds 1/K of the rotated
    weights, as on a flat ring of K) and an `hsdp` entry is added: FSDP2 sharding over K ranks.
    `autocast`: bf16 autocast over `dtype` weights. What travels then is counted in bf16: RTP's weight
    slots (but an embedding's lookup, float32 as vanilla's), FSDP2's gathered layers (its
    MixedPrecisionPolicy). Activations are still counted in `dtype`, an overestimate under autocast.

    `dtype`: the weights', a torch dtype or a name `DTYPES` holds ("bf16" too); "auto" (the default, as
    from_pretrained's) is the config's dtype, else float32 (`resolve_dtype`)."""
    terms = device_terms(device)
    dtype = _dtype(dtype, config)
    size = dtype.itemsize
    k = OPTIMIZER_STATES[optimizer]
    model = _meta_model(config, dtype)
    params = list(model.parameters())
    total = sum(p.numel() for p in params) * size
    largest = max(p.numel() for p in params) * size
    saved = _activations(model, batch, seq, True, gradient_checkpointing)
    logits = batch * seq * config.vocab_size * size
    n = world_size

    def peak(held: float, largest_local: float, activations: float, logits: float = logits) -> float:
        step = (2 + k) * held + 2 * largest_local
        backward = (1 + k) * held + activations + 2 * logits
        return max(step, backward) + terms.in_allocator

    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for p in params if id(p) not in in_layers) * size
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0) * size
    ring = n if rtp_size is None else rtp_size
    if ring < 1 or n % ring:
        raise ValueError(f"rtp_size={rtp_size} must divide the world size {n}")
    rtp_local, rtp_largest, piece, lookup = _rtp_local(model, ring, size, piece_bytes)
    travel = (
        min(size, torch.bfloat16.itemsize) if autocast else size
    )  # what the ring carries (distributed/transport/ring.py)
    weight_slot = max(piece * travel, lookup * size)
    pool = 0 if ring == 1 else (1 if ring == 2 else 2) * weight_slot + 2 * piece * size  # weight + gradient slots
    tp_local = _tp_local(model, n)
    # The fused loss keeps the backbone's activations, a copy of the head's input, two floats per
    # token and a few [token block, piece rows] float32 blocks while it runs: no logits at all.
    fused = (
        _activations(model, batch, seq, False, gradient_checkpointing, tiled_mlp, checkpoint_offload)
        + batch * seq * (config.hidden_size * size + 8)
        + 3 * min(terms.loss_tile, batch * seq * math.ceil(config.vocab_size / ring) * 4)
    )
    single = peak(total, largest, saved)
    unfused = (
        _activations(model, batch, seq, True, gradient_checkpointing, tiled_mlp, checkpoint_offload)
        if ring > 1
        else saved
    )

    def fsdp2(shards: int) -> float:
        # backward: the root unit (embeddings, head) and a decoder layer unsharded beside the local
        # batch's activations; then either the logits' gradient (at its start) or the root's unsharded
        # gradients (at its end), whichever is larger
        gathered = travel / size  # MixedPrecisionPolicy(param_dtype=bf16) gathers bf16 under autocast
        return (
            max(
                (2 + k) * total / shards + 2 * largest / shards,
                (1 + k) * total / shards + (root + 2 * layer) * gathered + saved + max(2 * logits, root),
            )
            + terms.in_allocator
        )

    result = {
        "single": single,
        # gradient buckets: a second copy of every gradient (gradient_as_bucket_view=False)
        "ddp": single + total,
        "fsdp2": fsdp2(n),
        # every rank runs the whole batch and gathers the full logits: their gradient and this rank's
        # slice of it coexist with the saved activations and all of its model states
        "tp": (2 + k) * tp_local * size + saved + logits * (1 + 1 / n) + terms.in_allocator,
        "rtp": single if ring == 1 else peak(rtp_local * size, rtp_largest * size, fused, logits=0) + pool,
        "rtp-unfused": single if ring == 1 else peak(rtp_local * size, rtp_largest * size, unfused) + pool,
    }
    if ring > 1:
        result["rtp-cp"] = (
            peak(
                rtp_local * size,
                rtp_largest * size,
                _context_parallel(
                    model,
                    batch,
                    seq,
                    ring,
                    size,
                    gradient_checkpointing,
                    terms.loss_tile,
                    tiled_mlp,
                    checkpoint_offload,
                ),
                logits=0,
            )
            + pool
            + _kv_slots(config, batch, seq, ring, size, weight_slot, piece * size)
        )
    if ring < n:
        result["hsdp"] = fsdp2(ring)
    if optimizer_offload:
        # On the device stay the parameters and their gradients (the step's temporaries are the host's): the larger
        # of the step (both) and backward's start (the parameters, the activations, the logits' gradient).
        def offloaded(held: float, activations: float, logits: float) -> float:
            return max(2 * held, held + activations + 2 * logits) + terms.in_allocator

        gathered = travel / size
        result["rtp-offload"] = (
            offloaded(total, saved, logits) if ring == 1 else offloaded(rtp_local * size, fused, 0) + pool
        )
        # FSDP2's CPUOffloadPolicy keeps sharded parameters, gradients and the step in host memory: on the device the
        # unsharded root and layers (with each layer's shard copied over before its all-gather), as fsdp2's backward
        result["fsdp2-offload"] = (
            (root + 2 * layer) * gathered + 2 * layer / n + saved + max(2 * logits, root) + terms.in_allocator
        )
        result["zero3-offload"] = zero3_device(
            config, n, batch=batch, seq=seq, gradient_checkpointing=gradient_checkpointing, terms=terms
        )
    for strategy in result:
        result[strategy] += outside_allocator(strategy, 1 if strategy == "single" else n, device, rtp_size)
    return result


def _context_parallel(
    model: Any,
    batch: int,
    seq: int,
    ring: int,
    size: int,
    gradient_checkpointing: bool,
    tile: int,
    tiled_mlp: bool | int | str = "auto",
    offload: bool = False,
) -> float:
    """The fused loss's activations when each rank holds 1/ring of every sequence (context parallelism): the
    ring attention keeps what a fused kernel keeps (q, k, v, output, log-sum-exp) for the rank's tokens."""
    local = math.ceil(seq / ring)
    config = model.config
    return (
        _activations(model, batch, local, False, gradient_checkpointing, tiled_mlp, offload)
        + batch * local * (config.hidden_size * size + 8)
        + 3 * min(tile, batch * local * math.ceil(config.vocab_size / ring) * 4)
    )


def _kv_slots(config, batch: int, seq: int, ring: int, size: int, weight_slot: int, grad_slot: int) -> float:
    """What ring attention adds to the pool and beside it: K/V blocks (the rank's own, contiguous, and two in
    flight in the weight slots), their travelling gradients (the gradient slots) and the rank's summed dK/dV."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    block = batch * math.ceil(seq / ring) * 2 * kv_heads * head_dim * size
    slots = 1 if ring == 2 else 2
    return slots * max(0, block - weight_slot) + 2 * max(0, block - grad_slot) + 2 * block


def checkpointed_inputs(model: Any, batch: int, seq: int) -> int:
    """Bytes of the decoder layers' inputs gradient checkpointing keeps for backward: what checkpoint offload
    (model/offload.py) holds in host memory instead."""
    layers = len(decoder_layers(model))
    return layers * batch * seq * model.config.hidden_size * next(model.parameters()).dtype.itemsize


def _activations(
    model: Any,
    batch: int,
    seq: int,
    labels: bool,
    gradient_checkpointing: bool,
    tiled_mlp: bool | int | str = False,
    offload: bool = False,
) -> float:
    """What autograd holds at backward's peak for `batch` x `seq` tokens per rank. With `tiled_mlp` (from_pretrained's
    setting, model/tiled_mlp.py's rule), MLPs it tiles keep no intermediate: one tile's exist at a time, in the
    backward that recomputes it. With `offload` (and checkpointing), the layers' inputs are in host memory, but the
    one a recomputation has fetched back and the one model/offload.py fetches meanwhile."""
    full = saved_activation_bytes(model, batch, seq, labels)
    tile = tiled_mlp_module.tile_for(tiled_mlp, batch * seq)
    working = 0.0
    if tile is not None:
        tiled = _tiled_trace(model, batch, seq, labels, tile)
        layers = max(1, len(decoder_layers(model)))
        working = (full - tiled) / (layers * batch * seq) * min(tile, batch * seq)  # one tile's MLP intermediates
        full = tiled
    if not gradient_checkpointing:
        return full + working
    # Checkpointed layers keep only their input, which the trace sees (torch.utils.checkpoint saves a checkpointed
    # call's inputs for backward through the saved-tensor hooks); backward recomputes one layer at a time. What lies
    # outside the layers (the final norm) is tiled too.
    if tile is None:
        outside = saved_activation_bytes(model, batch, seq, labels, gradient_checkpointing=True)
    else:
        outside = _tiled_trace(model, batch, seq, labels, tile, gradient_checkpointing=True)
    layers = max(1, len(decoder_layers(model)))
    # on the device meanwhile: the input of the layer recomputing and of the one before it, coming back
    host = checkpointed_inputs(model, batch, seq) * max(layers - 2, 0) / layers if offload else 0.0
    return outside - host + (full - outside) / layers + working


def _tiled_trace(
    model: Any, batch: int, seq: int, labels: bool, tile: int, gradient_checkpointing: bool = False
) -> int:
    """saved_activation_bytes with the model's MLPs and norms tiled (what each keeps then: its tiles' inputs, views
    of its input), the model left as it was."""
    tiled_mlp_module.install(model, tile)
    try:
        return saved_activation_bytes(model, batch, seq, labels, gradient_checkpointing=gradient_checkpointing)
    finally:
        tiled_mlp_module.uninstall(model)


# Optimizer state in host memory (`optimizer_offload`): the rows memory_offload.py's docstring describes.

# DeepSpeed's buckets as Trainer's `auto` config sizes them (transformers' integrations/deepspeed.py): a reduce
# bucket of hidden_size**2 elements and a prefetch bucket of 0.9 * hidden_size**2, in bf16.
ZERO3_BUCKETS = 1.0 + 0.9


def pinned(nbytes: float) -> int:
    """What torch's CachingHostAllocator takes for a pinned tensor of `nbytes`: the next power of two."""
    nbytes = math.ceil(nbytes)
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _trainable(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's trainable parameters, tied ones once, under their first name."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def rtp_local_numels(model: Any, world_size: int) -> list[int]:
    """Elements this rank holds of each trainable parameter under hf_rtp's plan: a rotated one's chunk (chunk 0, the
    largest), a replicated one whole."""
    from .. import plans
    from ..distributed.tensors.sharding import chunk_rows
    from ..plans.auto import auto_plan

    model_type = model.config.model_type
    plan = plans.get(model_type) if model_type in plans.supported() else auto_plan(model)
    rotated = plan.resolve(model).rotated_params
    numels = []
    for name, p in _trainable(model):
        if name in rotated and world_size > 1:
            start, end = chunk_rows(p.shape[0], world_size, 0)
            numels.append((end - start) * math.prod(p.shape[1:]))
        else:
            numels.append(p.numel())
    return numels


def host_bytes(
    config,
    world_size: int,
    *,
    dtype: str | torch.dtype = "auto",
    optimizer: str = "adamw",
    rtp_size: int | None = None,
    pin: bool = True,
) -> dict[str, float]:
    """Host memory per rank that each offloading strategy's optimizer holds (see the module's docstring); `pin`:
    the parameters are on CUDA, so the buffers that are pinned are rounded as torch's pinned allocator rounds them."""
    k = OPTIMIZER_STATES[optimizer]
    weights = _dtype(dtype, config)
    model = _meta_model(config, weights)
    n = world_size
    round_up = pinned if pin else math.ceil
    # CPUOffloadOptimizer stages a narrower parameter's rows (bf16) in their own dtype, pinned, to follow writes
    narrow = weights.itemsize if weights.itemsize < 4 else 0

    def staged(numels: list[int], rows: int = 0) -> float:
        # a float32 master and a gradient buffer (pinned), k moments (pageable), and `rows` bytes an element staged
        return sum(2 * round_up(4 * numel) + k * 4 * numel + round_up(rows * numel) for numel in numels)

    fsdp2 = [math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) for _, p in _trainable(model)]  # padded shards
    total = sum(p.numel() for _, p in _trainable(model))
    return {
        "rtp-offload": staged(rtp_local_numels(model, rtp_size or n), narrow),
        "fsdp2-offload": staged(fsdp2),
        "zero3-offload": (2 + k) * 4 * total / n,  # fp32 partitions of parameters and gradients, k moments
    }


def zero3_device(
    config,
    world_size: int,
    *,
    batch: int,
    seq: int,
    gradient_checkpointing: bool,
    terms: DeviceTerms,
) -> float:
    """DeepSpeed ZeRO-3 with offload_optimizer (bf16) on the device, per rank, before what the process holds outside
    the allocator (see the module's docstring)."""
    model = _meta_model(copy.deepcopy(config), torch.bfloat16)  # from_config sets the config's dtype
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    states = 4 * largest + 2 * total / world_size  # DeepSpeed's estimate_zero3_model_states_mem_needs
    buckets = ZERO3_BUCKETS * config.hidden_size**2 * 2
    activations = _activations(model, batch, seq, True, gradient_checkpointing)
    logits = batch * seq * config.vocab_size * 4  # transformers' loss upcasts the logits to float32
    return states + buckets + activations + 2 * logits + terms.in_allocator


def parser() -> argparse.ArgumentParser:
    """`hf-rtp estimate`'s arguments (memory_qlora.main runs it: full fine-tuning here, QLoRA there)."""
    p = argparse.ArgumentParser(
        prog="hf-rtp estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`hf-rtp estimate`'s options, added to `p` (the `hf-rtp` command's subparser, or parser()'s). This module
    imports nothing beyond what `import hf_rtp` has imported already, so `hf-rtp estimate --help` costs no
    more (tests/unit/test_public_surface.py)."""
    p.add_argument("model", help="a checkpoint folder, config.json, Hub id (config only) or bench preset")
    p.add_argument("--world-size", type=int, required=True, help="the ranks to estimate for")
    p.add_argument(
        "--rtp-size",
        type=int,
        help="ranks per RTP ring (default: the world size); also estimates HSDP sharding over as many ranks",
    )
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument(
        "--dtype",
        type=dtype_setting,
        default="auto",
        help="the weights' dtype: auto (default: the config's dtype, as from_pretrained(dtype='auto') takes it; "
        "float32 where it names none), bfloat16 (bf16), float16 (fp16, half), float32 (fp32, float) or float64",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATES),
        default="adamw",
        help="the optimizer whose state counts: adamw and adam keep 2 tensors per parameter, sgd-momentum 1, "
        "sgd none (default adamw)",
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="decoder layers recomputed in backward")
    p.add_argument(
        "--checkpoint-offload",
        action="store_true",
        help="with --gradient-checkpointing: the RTP rows with activation_checkpointing_enable(offload=True), each "
        "layer's checkpointed input in pinned host memory; prints the host memory a node of --gpus-per-node needs",
    )
    p.add_argument(
        "--optimizer-offload",
        action="store_true",
        help="adds the rows with the optimizer's state and step in host memory: hf_rtp.CPUOffloadOptimizer, FSDP2's "
        "CPUOffloadPolicy (accelerate's cpu_offload) and DeepSpeed ZeRO-3 with offload_optimizer, each with the host "
        "memory a node of --gpus-per-node needs",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="ranks per node, for the host memory --checkpoint-offload and --optimizer-offload print (default 8)",
    )
    p.add_argument(
        "--tiled-mlp",
        type=tiled_setting,
        default="auto",
        help="from_pretrained's tiled_mlp for the RTP rows: auto (default: tiles of 8192 tokens above 16384 per "
        "rank), on, off, or tokens per tile",
    )
    p.add_argument(
        "--device",
        choices=sorted(DEVICES),
        default="cuda",
        help="what each rank trains on (default cuda): on cuda the fused loss's CUDA tile, and per process the CUDA "
        "context, cuBLAS's workspaces, NCCL's buffers and the caching allocator's segments (estimated, from the "
        "sources hf_rtp.tools.memory names); cpu: host memory, as hf-rtp bench measures it on a CPU",
    )
    p.add_argument(
        "--autocast",
        action="store_true",
        help="bf16 autocast over --dtype weights: RTP's ring and FSDP2's gathers carry bf16",
    )
    p.add_argument(
        "--attn-implementation",
        help="as transformers' attn_implementation (default: the config's, "
        "else sdpa); eager keeps [seq, seq] attention scores for backward, the fused kernels do not",
    )
    p.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA: a frozen NF4 base (double quantization), LoRA on every linear layer, AdamW on the adapters",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA's r, with --load-in-4bit")


def tiled_setting(text: str) -> bool | int | str:
    """--tiled-mlp's text as from_pretrained's tiled_mlp (hf-rtp estimate, hf-rtp bench)."""
    named: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
    if text in named:
        return named[text]
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"auto, on, off or a positive number of tokens per tile, not {text!r}")


def resolved_dtype(args: argparse.Namespace, config) -> tuple[torch.dtype, str]:
    """--dtype for `config` (`resolve_dtype`); a config's dtype the estimate cannot take ends the command."""
    try:
        return resolve_dtype(args.dtype, config)
    except ValueError as err:
        raise SystemExit(f"hf-rtp estimate: {err}") from None


def dtype_note(dtype: torch.dtype, source: str) -> str:
    """How `hf-rtp estimate` names the dtype it counted in, and where it took it from."""
    return f"{str(dtype).removeprefix('torch.')} ({source})"


def device_note(device: str) -> str:
    """The line `hf-rtp estimate` prints about what its figures hold beyond the tensors."""
    terms = device_terms(device)
    if terms is CPU:
        return "  on a CPU: host memory per rank, with the 35 MB a step holds beyond its tensors (measured here)"
    return (
        f"  on CUDA, per rank's process: the tensors, {terms.in_allocator / 1e9:.2f} GB of cuBLAS workspaces and "
        f"allocator segments, a {terms.context / 1e9:.2f} GB CUDA context and {terms.per_group / 1e9:.2f} GB of "
        "NCCL buffers per process group (estimated from published figures, not measured)"
    )


def main(argv=None, args: argparse.Namespace | None = None) -> dict[str, float]:
    """Full fine-tuning's estimate; `hf-rtp estimate` (memory_qlora.main) also takes --load-in-4bit. `args`: `argv`
    already parsed (by memory_qlora.parser, which adds --speed's options)."""
    args = parser().parse_args(argv) if args is None else args
    if args.world_size < 1:
        raise SystemExit("--world-size must be at least 1")
    if args.load_in_4bit:
        raise SystemExit("--load-in-4bit: call hf_rtp.tools.memory_qlora.main (or hf-rtp estimate)")
    if args.checkpoint_offload and not args.gradient_checkpointing:
        raise SystemExit("--checkpoint-offload moves what gradient checkpointing keeps: add --gradient-checkpointing")
    if args.rtp_size is not None and (args.rtp_size < 1 or args.world_size % args.rtp_size):
        raise SystemExit(f"--rtp-size must divide --world-size {args.world_size}, got {args.rtp_size}")
    config = config_from(args)
    dtype, source = resolved_dtype(args, config)
    result = estimate(
        config,
        args.world_size,
        batch=args.batch,
        seq=args.seq,
        dtype=dtype,
        optimizer=args.optimizer,
        gradient_checkpointing=args.gradient_checkpointing,
        rtp_size=args.rtp_size,
        autocast=args.autocast,
        device=args.device,
        tiled_mlp=args.tiled_mlp,
        checkpoint_offload=args.checkpoint_offload,
        optimizer_offload=args.optimizer_offload,
    )
    states = model_states_bytes(config, dtype, args.optimizer)
    print(
        f"{config.model_type}: model states {states / 1e9:.3f} GB in {dtype_note(dtype, source)}, {args.optimizer}; "
        f"batch {args.batch}x{args.seq} per rank, {args.world_size} rank(s)"
        + (f" as {args.world_size // args.rtp_size} replicas of {args.rtp_size}-rank rings" if args.rtp_size else "")
    )
    print(device_note(args.device))
    for strategy, value in result.items():
        note = {
            "single": "   (1 process)",
            "rtp": "   (fused LM-head loss, the default)",
            "rtp-unfused": "   (from_pretrained(..., fused_loss=False))",
            "hsdp": f"   (FSDP2 sharded over {args.rtp_size}, replicated across)",
            "rtp-cp": f"   (context parallelism: a sequence cut across {args.rtp_size or args.world_size} ranks)",
            "rtp-offload": "   (hf_rtp.CPUOffloadOptimizer)",
            "fsdp2-offload": "   (FSDP2 with CPUOffloadPolicy, estimated)",
            "zero3-offload": "   (DeepSpeed ZeRO-3 with offload_optimizer, bf16, estimated)",
        }.get(strategy, "")
        print(f"  {strategy:<13} {value / 1e9:7.3f} GB per rank" + note)
    if args.checkpoint_offload:
        model = _meta_model(config, dtype)
        ring = args.rtp_size or args.world_size
        per_node = min(args.gpus_per_node, args.world_size)
        rtp, cp = (checkpointed_inputs(model, args.batch, s) for s in (args.seq, math.ceil(args.seq / ring)))
        print(
            f"  checkpoint offload, pinned host memory per node of {per_node} GPUs: {rtp * per_node / 1e9:.1f} GB "
            f"for rtp, {cp * per_node / 1e9:.1f} GB for rtp-cp (each rank's checkpointed layer inputs)"
        )
    if args.optimizer_offload:
        per_node = min(args.gpus_per_node, args.world_size)
        host = host_bytes(
            config,
            args.world_size,
            dtype=dtype,
            optimizer=args.optimizer,
            rtp_size=args.rtp_size,
            pin=args.device == "cuda",
        )
        print(
            f"  optimizer offload, host memory per node of {per_node} GPUs (float32 masters, gradient buffers and "
            f"{args.optimizer}'s state): "
            + ", ".join(f"{value * per_node / 1e9:.1f} GB for {strategy}" for strategy, value in host.items())
        )
    return result
