"""One rank of one strategy in the benchmark: load the checkpoint, train a few steps, report.

    python -m hf_rtp.tools.bench.worker STRATEGY CHECKPOINT --batch 2 --seq 128 --warmup 2 --steps 5

Run by `hf_rtp.tools.bench.run` with RANK/WORLD_SIZE set; prints one JSON line. Marks are wall-clock
times, so the parent can cut its VmRSS samples into the load and training phases.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..memory import STRATEGIES, decoder_layers
from .processes import vm_rss

# hf_rtp's first rotated from_pretrained imports PEFT (its stand-ins), and PEFT imports bitsandbytes when that
# is installed (about 45 MB resident): imported here, before every strategy's baseline, as transformers is,
# so that a peak measures loading and training, not a library import that one strategy happens to trigger.
with contextlib.suppress(ImportError):
    import peft  # noqa: F401

# RTP variants the bench runs beside the strategies: the plain loss from full logits, a zero loss
# that skips the head and its loss altogether (what the loss costs is the difference), rings of
# --rtp-size ranks as data-parallel replicas (the 2-D layout) instead of one flat ring, and context
# parallelism (one batch of sequences cut across the ring: hf_rtp.context_parallel), and rtp with its optimizer's
# state and step in host memory (hf_rtp.CPUOffloadOptimizer around torch's AdamW; issue 68, point 4).
VARIANTS = ("rtp-unfused", "rtp-zero-loss", "rtp-2d", "rtp-cp", "rtp-offload")
SHARED_BATCH = ("tp", "rtp-cp")  # every rank gets the same batch: the strategy cuts it, not the data loader


def load(
    strategy: str,
    checkpoint: str,
    dtype: torch.dtype,
    device: torch.device,
    gradient_checkpointing: bool = False,
    rtp_size: int | None = None,
    autocast: bool = False,
    tiled_mlp: bool | int | str = "auto",
    fsdp2_prefetch: int = 0,
) -> Any:  # a transformers model, or DDP around one
    model = _load(strategy, checkpoint, dtype, device, rtp_size, autocast, tiled_mlp, fsdp2_prefetch)
    if gradient_checkpointing:
        inner = getattr(model, "module", model)
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        inner.config.use_cache = False
    return model


def _load(
    strategy: str,
    checkpoint: str,
    dtype: torch.dtype,
    device: torch.device,
    rtp_size: int | None,
    autocast: bool,
    tiled_mlp: bool | int | str = "auto",
    fsdp2_prefetch: int = 0,
) -> Any:  # a transformers model, or DDP around one
    from transformers import AutoModelForCausalLM

    if strategy.startswith("rtp"):
        import hf_rtp

        return hf_rtp.from_pretrained(
            checkpoint,
            dtype=dtype,
            device=device,
            attn_implementation="sdpa",
            fused_loss=strategy in ("rtp", "rtp-2d", "rtp-cp", "rtp-offload"),
            rtp_size=rtp_size if strategy == "rtp-2d" else None,
            rotation_moves="weights" if strategy == "rtp-weights" else "auto",  # decode as before tokens could move
            tiled_mlp=tiled_mlp,
        )
    if strategy == "tp":
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, tp_plan="auto")
    model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device)
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # under autocast, FSDP2's own mixed precision: bf16 all-gathers, float32 reduce-scatters
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if autocast else None
        kwargs: dict[str, Any] = {"mp_policy": policy} if policy else {}
        # one unit per decoder layer, resharded after its forward and gathered again in backward; the root holds
        # the rest (embeddings, final norm, head) and keeps them gathered from its forward to backward, FSDP2's
        # default for a root (accelerate's FSDP2 wraps a model so; torchtitan adds the embeddings and the
        # norm with the head as units of their own, which a head tied to the embeddings cannot be)
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, reshard_after_forward=True, **kwargs)
        fully_shard(model, **kwargs)
        prefetch(layers, fsdp2_prefetch)
    return model


def prefetch(layers: list, ahead: int) -> None:
    """FSDP2's explicit prefetching over decoder layers sharded one a unit: in forward each layer's all-gather
    issues the next `ahead` layers', in backward the previous `ahead` layers' (pytorch/examples' FSDP2
    --explicit-prefetch). 0 leaves FSDP2's implicit prefetching, torchtitan's for a dense Llama."""
    if ahead < 0:
        raise ValueError(f"fsdp2 prefetch must be 0 (implicit) or a number of layers, got {ahead}")
    if ahead == 0:
        return
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + ahead])
        if i > 0:
            layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead) : i][::-1])


QLORA_STRATEGIES = ("ddp", "fsdp2", "rtp")
LORA_RANK = 16


def load_qlora(strategy: str, checkpoint: str, dtype: torch.dtype, device: torch.device) -> Any:
    """QLoRA as each strategy's users run it: a frozen NF4 base (double quantization, bitsandbytes), LoRA
    adapters on every linear (PEFT), under DDP, under FSDP2 as Answer.AI's FSDP-QLoRA sets it (the packed
    bytes stored as `dtype` so FSDP shards them, the quantization state whole on every rank), or hf_rtp."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if strategy not in QLORA_STRATEGIES:
        raise SystemExit(f"{strategy} has no QLoRA variant in the bench (--load-in-4bit runs {QLORA_STRATEGIES})")
    storage = dtype if strategy == "fsdp2" else torch.uint8
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=storage,
    )
    if strategy == "rtp":
        import hf_rtp

        base = hf_rtp.from_pretrained(checkpoint, dtype=dtype, device=device, quantization_config=quantization)
    else:
        base = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=dtype, quantization_config=quantization, device_map={"": device}
        )
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear")
    model: Any = get_peft_model(base, lora)
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    return model


def train_step(
    model: nn.Module, strategy: str, batch: torch.Tensor, optimizer: torch.optim.Optimizer, autocast: bool = False
) -> float:
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
        return _train_step(model, strategy, batch, optimizer)


def _train_step(model, strategy, batch, optimizer) -> float:
    if strategy == "rtp-zero-loss":
        loss = model.model(input_ids=batch).last_hidden_state.sum() * 0
        loss.backward()
        for p in model.parameters():  # the head still takes its optimizer step, on a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    elif strategy == "rtp-cp":
        import hf_rtp

        inputs = {"input_ids": batch, "labels": batch}
        with hf_rtp.context_parallel(model, inputs):
            loss = model(**inputs).loss
            loss.backward()
    else:
        with record_function("bench: forward"):  # the phases, named in --profile's traces
            loss = model(input_ids=batch, labels=batch).loss
        with record_function("bench: backward"):
            loss.backward()
    if strategy.startswith("rtp"):
        import hf_rtp

        with record_function("bench: sync_grads"):
            hf_rtp.sync_grads(model)  # replicated norms; the ring already averaged the rotated weights
    with record_function("bench: optimizer step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss)


def _step_alone(model, strategy: str, batch, optimizer, autocast: bool, device: torch.device) -> None:
    """One training step begun together and ended on the device, as the measured ones are."""
    if dist.is_initialized():
        dist.barrier()
    train_step(model, strategy, batch, optimizer, autocast)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(step, directory: str, name: str, device: torch.device) -> list[str]:
    """Run `step()` twice under torch.profiler, recording the second (the first warms the profiler up), and write
    DIRECTORY/NAME.json.gz (a Chrome trace, for chrome://tracing or Perfetto) and DIRECTORY/NAME-key-averages.txt
    (the ops by self time on the device, then by total time on the host); the paths written."""
    from torch.profiler import ProfilerActivity, profile, schedule

    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, name)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    written: list[str] = []

    def save(prof) -> None:
        prof.export_chrome_trace(base + ".json.gz")  # gzipped by its suffix
        averages = prof.key_averages()
        sorts = [("self_device_time_total", "self time on the device")] if cuda else []
        sorts.append(("cpu_time_total", "total time on the host (CPU)"))
        with open(base + "-key-averages.txt", "w") as f:
            for key, title in sorts:
                f.write(f"{name}: one step's ops by {title}\n{averages.table(sort_by=key, row_limit=50)}\n\n")
        written.extend([base + ".json.gz", base + "-key-averages.txt"])

    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1), on_trace_ready=save) as prof:
        for _ in range(2):
            step()
            prof.step()
    return written


def environment(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on: the device, torch, CUDA, and the NCCL this process runs beside the one
    torch was built with (torch.cuda.nccl.version(); .ci/gpu-device may replace the library), and the CUDA MPS
    client's variables (set where .ci/gpu-speed started MPS)."""
    import platform

    import transformers

    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": str(dist.get_backend()) if dist.is_initialized() else None,
    }
    if device.type != "cuda":
        return {**env, "device_name": platform.processor() or platform.machine() or "cpu"}
    props = torch.cuda.get_device_properties(device)
    built = torch.cuda.nccl.version()
    return {
        **env,
        "device_name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "device_memory_gb": props.total_memory / 1e9,
        "cuda": torch.version.cuda,
        "nccl_built": ".".join(map(str, built)) if isinstance(built, tuple) else str(built),
        "nccl_loaded": loaded_nccl(),
        **{
            name.lower(): os.environ.get(name)
            for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "NCCL_MULTI_RANK_GPU_ENABLE")
        },
    }


def nccl_version(code: int) -> str:
    """ncclGetVersion's integer, dotted: X*10000 + Y*100 + Z since NCCL 2.9, X*1000 + Y*100 + Z before."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def loaded_nccl() -> str | None:
    """The version of the NCCL library this process has loaded by the name libnccl.so.2 (the one torch calls),
    read with its own ncclGetVersion; None where none is loaded."""
    import ctypes

    try:
        library = ctypes.CDLL("libnccl.so.2", mode=4)  # RTLD_NOLOAD (glibc): only a library already loaded
    except OSError:
        return None
    code = ctypes.c_int()
    return nccl_version(code.value) if library.ncclGetVersion(ctypes.byref(code)) == 0 else None


def make_optimizer(strategy: str, params: list) -> torch.optim.Optimizer:
    """Every strategy's AdamW at lr 1e-5; rtp-offload's is the same AdamW stepped in host memory on each rank's rows
    (hf_rtp.CPUOffloadOptimizer: the gradients copied to the host, the step there, the rows copied back)."""
    if strategy == "rtp-offload":
        import hf_rtp

        return hf_rtp.CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-5)
    return torch.optim.AdamW(params, lr=1e-5)


def _ring(model: nn.Module):
    """The ring of a rotated model (its sent_bytes count what a step puts on the wire), else None."""
    from ...model.state import state_of

    state = state_of(model, required=False)
    return state.topology.ring if state is not None and state.topology.rtp_size > 1 else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("strategy", choices=STRATEGIES + VARIANTS + ("rtp-weights", "rtp-whole"))
    p.add_argument("checkpoint")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda (this rank's LOCAL_RANK GPU) or cuda:N (every rank's)")
    p.add_argument("--backend", help="the process group's backend (default: nccl on cuda, gloo on cpu)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--tiled-mlp", default="auto", help="from_pretrained's tiled_mlp: auto, on, off or tokens per tile")
    p.add_argument("--rtp-size", type=int)
    p.add_argument("--autocast", action="store_true", help="bf16 autocast over the weights' dtype")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: a frozen NF4 base with LoRA adapters")
    p.add_argument("--fsdp2-prefetch", type=int, default=0, help="fsdp2: 0 implicit, N explicit (layers ahead)")
    p.add_argument("--profile", help="a folder: one more step under torch.profiler, written there")
    p.add_argument("--generate", help="comma-separated batch sizes: time greedy decoding instead of training")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # one GPU per rank; cuda:N puts every rank on GPU N
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))
    dtype = getattr(torch, args.dtype)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.checkpoint).vocab_size
    # Tensor parallelism needs the same batch on every rank; the data-parallel strategies each take their own.
    seed = 0 if args.strategy in SHARED_BATCH else rank
    batches = torch.randint(
        0, vocab, (args.warmup + args.steps, args.batch, args.seq), generator=torch.Generator().manual_seed(seed)
    ).to(device)

    marks = {"baseline_rss": vm_rss(os.getpid()), "load_start": time.time()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.load_in_4bit:
        model = load_qlora(args.strategy, args.checkpoint, dtype, device).train()
    else:
        from ..memory import tiled_setting

        model = load(
            args.strategy, args.checkpoint, dtype, device, args.gradient_checkpointing, args.rtp_size, args.autocast,
            tiled_setting(args.tiled_mlp), args.fsdp2_prefetch,
        ).train()  # fmt: skip
    marks["load_end"] = time.time()
    if args.generate:
        report = dict(
            marks,
            rank=rank,
            world_size=world_size,
            load_s=marks["load_end"] - marks["load_start"],
            decode=decode(model, args, vocab, seed, device),
        )
        print(json.dumps(report), flush=True)
        return _finish()
    if device.type == "cuda":
        marks["cuda_load_peak"] = torch.cuda.max_memory_allocated(device)
        marks["cuda_load_reserved"] = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = make_optimizer(args.strategy, [q for q in model.parameters() if q.requires_grad])
    ring = _ring(model)
    times, losses, sent, hops = [], [], [], []
    for batch in batches:
        before = ring.sent_bytes if ring is not None else 0
        hops_before = ring.exchanges if ring is not None else 0
        if world_size > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        losses.append(train_step(model, args.strategy, batch, optimizer, args.autocast))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world_size > 1:
            dist.barrier()  # a step ends when the slowest rank ends it
        times.append(time.perf_counter() - start)
        sent.append(ring.sent_bytes - before if ring is not None else 0)
        hops.append(ring.exchanges - hops_before if ring is not None else 0)
    marks["train_end"] = time.time()
    if device.type == "cuda":
        marks["cuda_train_peak"] = torch.cuda.max_memory_allocated(device)
        marks["cuda_train_reserved"] = torch.cuda.max_memory_reserved(device)
    local_bytes = sum((q.to_local() if hasattr(q, "to_local") else q).nbytes for q in model.parameters())
    extra: dict[str, Any] = {}
    if args.strategy == "fsdp2" and not args.load_in_4bit:
        from torch.distributed.fsdp import FSDPModule

        extra["fsdp2"] = {
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),  # a unit per decoder layer, the root
            "layers_reshard_after_forward": True,
            "root_reshard_after_forward": False,  # FSDP2's default for a root
            "prefetch": f"explicit, {args.fsdp2_prefetch} layer(s) ahead" if args.fsdp2_prefetch else "implicit",
        }
    if args.profile:  # after the measured steps and their peaks: the profiler's own memory and time are in neither
        step = functools.partial(_step_alone, model, args.strategy, batches[-1], optimizer, args.autocast, device)
        try:  # a profiler that fails (CUPTI under CUDA MPS, say) costs the profile, not the figures measured
            extra["profile"] = profile_steps(step, args.profile, f"{args.strategy}-rank{rank}", device)
        except Exception as err:
            extra["profile_error"] = f"{type(err).__name__}: {err}"[-2000:]
    report = dict(
        marks,
        **extra,
        rank=rank,
        world_size=world_size,
        environment=environment(device),
        parameters=sum(q.numel() for q in model.parameters()),  # global: DTensors count their whole shape
        step_times=times[args.warmup :],
        step_s=statistics.median(times[args.warmup :]),
        losses=losses,
        ring_bytes_per_step=statistics.median(sent[args.warmup :]),
        exchanges_per_step=statistics.median(hops[args.warmup :]),
        local_param_bytes=local_bytes,
        load_s=marks["load_end"] - marks["load_start"],
    )
    print(json.dumps(report), flush=True)
    del model, optimizer
    _finish()


def _finish() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def decode(model: Any, args, vocab: int, seed: int, device: torch.device) -> list[dict]:
    """Greedy `generate` of exactly --new-tokens tokens per batch size, after one short warm-up:
    seconds (the slowest rank's) and wall-clock marks, so the parent can cut the phase's peak. For
    rtp-whole, also the seconds hf_rtp.whole_model took to gather the copy it decodes with."""
    model = getattr(model, "module", model).eval()
    gather_s = None
    if args.strategy == "rtp-whole":  # hf_rtp.whole_model: decode on a gathered copy, beside the rotated model
        import hf_rtp

        start = time.perf_counter()
        model = hf_rtp.whole_model(model)
        gather_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for batch in [int(b) for b in args.generate.split(",")]:
        prompt = torch.randint(0, vocab, (batch, args.seq), generator=generator).to(device)
        options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
            model.generate(prompt[:, :8], max_new_tokens=2, min_new_tokens=2, **options)  # warm-up
            if dist.is_initialized():
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start_mark, start = time.time(), time.perf_counter()
            out = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **options)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if dist.is_initialized():
                dist.barrier()
        assert out.shape[1] == args.seq + args.new_tokens
        runs.append(
            {
                "batch": batch,
                "seconds": time.perf_counter() - start,
                "start": start_mark,
                "end": time.time(),
                "gather_s": gather_s,
            }
        )
        if device.type == "cuda":
            runs[-1]["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    return runs


if __name__ == "__main__":
    main()
