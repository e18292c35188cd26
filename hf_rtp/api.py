"""from_pretrained, read as its steps (each in hf_rtp/loader.py), and the AutoModelFor... classes that call it."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import transformers
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from . import keywords, loader, plans
from .binding import bind
from .errors import KeywordError
from .integrations import trainer as trainer_integration
from .model import offload
from .model import tiled_mlp as tiled_mlp_module
from .model.forward import install_forward
from .model.heads import is_causal_lm, model_class
from .model.state import RTPState
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
    tiled_mlp: bool | int | str = "auto",
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
            reproduce keep the plain loss (logged). False: always the plain loss, transformers' own on the
            logits. Both compute in float32 whatever the model's dtype, in different orders: a comparison with
            vanilla in float64 needs False (docs/testing.md, "Comparing with vanilla yourself").
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
        tiled_mlp: run each decoder layer's MLP, and each norm outside attention, over tiles of its tokens, so
            that at long sequences their intermediate activations (an RMSNorm's float32 copies of a bf16 input
            among them) exist for one tile at a time, in forward and in backward (each tile under
            torch.utils.checkpoint: one more forward of the MLP and the norms). "auto" (default): tiles of 8192
            tokens where an input holds more than 16384 (per rank: under context parallelism, its own); True:
            tiles of 8192 above 8192; an int: tiles of that many tokens; False: never. Blocks of experts
            are left whole by "auto" and refused by name otherwise; an MLP whose dropout is active runs whole,
            with a warning. The same outputs and gradients as untiled, up to the order of the weight
            gradients' sums (model/tiled_mlp.py).
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
    settings = Settings.resolve(
        options.device,
        timeout,
        rotation_piece_size,
        verify_weights,
        fused_loss,
        reduce_dtype,
        rotation_moves,
        tiled_mlp,
    )
    topology = loader.start(settings, device_mesh, rtp_size)
    hub = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only)
    source = loader.resolve(pretrained_model_name_or_path, options, hub, auto_class, topology)
    auto_class = model_class(auto_class, source.config)  # before any read: a wrong head fails naming the right one
    plan = loader.named_plan(plan, source.config)
    dtype = loader.find(source, options, topology)
    loader.agree_on_checkpoint(source, plan, settings, dtype, auto_class, topology)
    model, chosen, resolution = loader.build(auto_class, source, dtype, plan, topology)
    read = loader.read(model, resolution, source, dtype, settings, topology)
    loader.install_weights(model, resolution, read, source, dtype, options, topology)
    spec = settings.load_spec(device_mesh, topology.rtp_size, plan)
    bind(model, RTPState(topology, chosen, resolution, read.sources, spec), load=from_pretrained)
    if is_causal_lm(model):
        install_forward(model, fused=settings.fused_loss and topology.rtp_size > 1)
    tiled_mlp_module.install(model, settings.tiled_mlp)
    offload.install(model, settings.device, topology.ring if topology.rtp_size > 1 else None)
    return loader.loaded(model, chosen, resolution, read, options, topology)


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


def attach_trainer(trainer):
    """Make `trainer` save, resume and load its rotated model collectively and data-parallel correctly.

    Automatic when Trainer.__init__ moves the model to its device; call it yourself right after building a
    Trainer that does not (place_model_on_device=False, bf16_full_eval=True, fp16_full_eval=True). Raises
    IntegrationError when the installed transformers declares the replaced methods differently from the
    tested versions. Returns `trainer`.
    """
    return trainer_integration.attach_trainer(trainer, load=from_pretrained)
