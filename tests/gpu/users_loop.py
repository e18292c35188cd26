"""A user's own training loop under torchrun, where hf_rtp starts the world itself, beside vanilla DDP in the same
processes (.ci/gpu's users-loop stage; docs/testing.md, "On a GPU").

The loop is the same for both: DDP around the model, AdamW, `loss.backward()`, `optimizer.step()`; only the load
line differs (`hf_rtp.from_pretrained` against `AutoModelForCausalLM.from_pretrained`). Nothing calls
`init_process_group`: hf_rtp's first `from_pretrained` starts the world from torchrun's environment (NCCL on
`cuda:0`, both ranks sharing the GPU with NCCL_MULTI_RANK_GPU_ENABLE=1; gloo on the CPU), and vanilla's DDP then
runs in that world. Each variant, from the same checkpoint, three models side by side:

- float32: float32 weights (TF32 off, torch's default for matmuls); gradient checkpointing with offload on
  (hf_rtp's `activation_checkpointing_enable(offload=True)`: pinned host memory on CUDA, ignored by name on the
  CPU), the MLPs tiled on the ring (`tiled_mlp`, two tiles per rank); vanilla with transformers' own checkpointing;
- autocast: float32 weights under bf16 autocast, the same features;
- autocast-untiled: the same, checkpointing on, the MLPs whole and offload off: the ring's own sums under autocast,
  apart from tiling, which rounds each tile's weight gradient to bf16 where vanilla's one matmul rounds once;
- lora-bf16: LoRA adapters (PEFT's defaults, all linear layers) on a bf16 base, checkpointing on;
- offload-optimizer: float32, checkpointing on, hf_rtp's model stepped by `hf_rtp.CPUOffloadOptimizer` around AdamW
  (issue 68), vanilla's by AdamW on the device; its state must be in host memory, the masters pinned on CUDA, and
  its training state saved and loaded into a fresh one must be equal. Not run on the CPU by default:
  test_offload_optimizer.py compares it there, exactly;

and for each: hf_rtp, vanilla DDP, and vanilla DDP with every rank's batch in reversed order (the noise floor,
noise_floor.py). Before any optimizer step the first backward's gradients are compared (hf_rtp's rotated ones as
this rank's rows): hf_rtp within FACTOR x the floor, and where vanilla's gradients are float32, vanilla's per-rank
gradients summed in bf16 outside it (the check can fail). Then `--steps` AdamW steps from the same start, each
rank's loss compared step by step the same way. Last, on float32 weights, `generate` greedy and sampled (a seed per
rank) on each rank's prompts: the tokens equal vanilla's.

    python tests/gpu/users_loop.py --device cuda:0 --out DIR   # launches torchrun (2 ranks), then judges
    python tests/gpu/users_loop.py --device cpu --out DIR      # the same at a tiny shape over gloo (CI's check)

Exits 0 when every comparison holds, 1 when one does not (each named), 77 when it cannot run here (no CUDA, or no
NCCL that lets two ranks share the GPU: hf_rtp starts NCCL itself). Writes DIR/rank-R.json and DIR/users-loop.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
for path in (HERE, TESTS, ROOT):  # gpu_world and noise_floor, support.*, hf_rtp from the tree
    if path not in sys.path:
        sys.path.insert(0, path)

SKIPPED = 77  # a stage's "cannot run here" (.ci/gpu-stages.sh)
VARIANTS = {  # name: (weights' dtype, bf16 autocast, tiled MLP and offload, LoRA)
    "float32": ("float32", False, True, False),
    "bf16": ("bfloat16", False, True, False),
    "autocast": ("float32", True, True, False),
    "autocast-untiled": ("float32", True, False, False),  # the ring's sums alone: tiling rounds per tile (testing.md)
    "lora-bf16": ("bfloat16", False, False, True),
    "offload-optimizer": ("float32", False, False, False),  # hf_rtp.CPUOffloadOptimizer around AdamW (issue 68)
}
HOST_STEP = ("offload-optimizer",)  # hf_rtp's model steps its optimizer in host memory; vanilla's AdamW on the device
CPU_SKIPS = HOST_STEP  # on the CPU, test_offload_optimizer.py compares it (exactly, at 2 and 3 ranks); CI's time
SHAPES = {  # a GPU shape whose layer inputs pass offload's 1 MiB threshold (model/offload.py), and CI's tiny one
    "cuda": dict(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=1024, seq=1024),
    "cpu": dict(hidden_size=32, intermediate_size=40, max_position_embeddings=64, seq=32),
}
BATCH = 2  # sequences per rank: two, so that reversing them reorders every weight gradient's sum
TILES = 2  # per rank and MLP
LR = 1e-3
NEW_TOKENS = 12


def _batch(step: int, world: int, rank: int, seq: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (world, BATCH, seq), generator=gen)[rank]


def _load(ckpt, name, which, device, seq):
    """One of the three models of a variant, ready for the loop: `which` is "rtp" or "vanilla"."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_rtp

    dtype, _, features, lora = VARIANTS[name]
    dtype = getattr(torch, dtype)
    if which == "rtp":
        tiled = BATCH * seq // TILES if features else False
        model = hf_rtp.from_pretrained(ckpt, dtype=dtype, device=device, tiled_mlp=tiled)
        # hf_rtp's offload (model/offload.py): pinned host memory on a side stream on CUDA; ignored on the CPU
        model.activation_checkpointing_enable({"use_reentrant": False}, offload=features)
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapters on every model of the variant (B zero: PEFT's default)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    return model.train()


def _trainable_grads(model, world, rank, rows_of=None):
    """{name: gradient} of the trainable parameters; rotated ones as this rank's rows, and with `rows_of` (hf_rtp's
    model) vanilla's gradients cut to the rows hf_rtp's rank holds."""
    from support.compare import rows
    from torch.distributed.tensor import DTensor

    out = {}
    rotated = {n: p for n, p in rows_of.named_parameters()} if rows_of is not None else {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad.to_local() if isinstance(p, DTensor) else p.grad
        if isinstance(rotated.get(name), DTensor):
            g = g[rows(rotated[name], world, rank)]
        out[name] = g.detach().clone()
    return out


def _variant(ckpt, name, device, steps, seq, vocab, out):
    """One variant's three models through the same loop: gaps before the first step, losses of every step."""
    import torch
    import torch.distributed as dist
    from noise_floor import bf16_accumulated, gaps
    from torch.nn.parallel import DistributedDataParallel as DDP

    started = time.monotonic()
    _, autocast, _, lora = VARIANTS[name]
    models = {which: _load(ckpt, name, which.split("-")[0], device, seq) for which in ("rtp", "vanilla", "vanilla-b")}
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [device.index] if device.type == "cuda" else None
    wrapped = {k: DDP(m, device_ids=ids) for k, m in models.items()}
    optimizers = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)
                  for k, m in models.items()}  # fmt: skip
    if name in HOST_STEP:
        import hf_rtp

        optimizers["rtp"] = hf_rtp.CPUOffloadOptimizer(
            [p for p in models["rtp"].parameters() if p.requires_grad], torch.optim.AdamW, lr=LR
        )
    context = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def loss_of(which, step):
        batch = _batch(step, world, rank, seq, vocab).to(device)
        if which == "vanilla-b":
            batch = batch.flip(0)  # the other reduction order: the same tokens, their sums in another order
        with context:
            return wrapped[which](input_ids=batch, labels=batch).loss

    # vanilla's gradient on this rank's batch alone, then every rank's: what a bf16 accumulator would sum
    per_rank = None
    if autocast or lora:  # vanilla's gradients are float32 here; with bf16 weights its own DDP sums in bf16
        with wrapped["vanilla"].no_sync():
            loss_of("vanilla", 0).backward()
        mine = _trainable_grads(models["vanilla"], world, rank)
        per_rank = [{} for _ in range(world)]
        for name_, g in mine.items():
            everyone = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(everyone, g.contiguous())
            for r in range(world):
                per_rank[r][name_] = everyone[r]
        optimizers["vanilla"].zero_grad(set_to_none=True)

    losses: dict[str, list[float]] = {k: [] for k in models}
    result: dict = {}
    for step in range(steps):
        for which in models:
            loss = loss_of(which, step)
            loss.backward()
            losses[which].append(loss.item())
        if step == 0:  # before any optimizer step
            vanilla = _trainable_grads(models["vanilla"], world, rank)
            rows = _trainable_grads(models["vanilla"], world, rank, rows_of=models["rtp"])
            result["grad_gaps"] = gaps(_trainable_grads(models["rtp"], world, rank), rows)
            result["floor"] = gaps(_trainable_grads(models["vanilla-b"], world, rank), vanilla)
            result["bf16"] = gaps(bf16_accumulated(per_rank), vanilla) if per_rank else None
            result["compared"] = len(vanilla)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    rtp = models["rtp"]
    base = rtp.get_base_model() if lora else rtp
    if name in HOST_STEP:  # where the state lives: every tensor of it on the host, the masters pinned on CUDA
        host = optimizers["rtp"]
        result["state_places"] = sorted(
            {str(t.device) for state in host.state.values() for t in state.values() if torch.is_tensor(t)}
        )
        result["masters_pinned"] = all(m.is_pinned() for m in host._masters.values())
        result["masters"] = len(host._masters)
        # its training state saved from host memory (rotated tensors with host rows) and loaded into a fresh one
        import hf_rtp

        folder = os.path.join(out, "offload-state")
        hf_rtp.save_training_state(folder, rtp, host)
        fresh = hf_rtp.CPUOffloadOptimizer([p for p in rtp.parameters() if p.requires_grad], torch.optim.AdamW, lr=LR)
        hf_rtp.load_training_state(folder, rtp, fresh)
        result["resumed_state_gaps"] = sorted(
            f"{n}.{k}"
            for n, p in rtp.named_parameters()
            for k, v in host.state.get(p, {}).items()
            if torch.is_tensor(v) and not torch.equal(v, fresh.state[p][k])
        )
    result.update(
        losses=losses,
        rotated=sum(hasattr(p, "to_local") for p in rtp.parameters()),
        tiled=sum("forward" in vars(m) for n, m in base.named_modules() if n.endswith(".mlp")),
        checkpointing=bool(base.is_gradient_checkpointing),
        dtypes=sorted({str(p.dtype) for p in rtp.parameters() if p.requires_grad}),
        places=sorted({str(p.device) for p in rtp.parameters()}),
        seconds=time.monotonic() - started,
    )
    wrapped.clear(), models.clear(), optimizers.clear()  # DDP and the models gone before the next variant's
    gc.collect()
    return result


def _generate(ckpt, device, vocab):
    """Greedy and sampled tokens of hf_rtp and of vanilla on this rank's prompts, float32 weights."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = dist.get_rank()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device).eval()
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, vocab, (dist.get_world_size(), 2, 6), generator=gen)[rank].to(device)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    out = {}
    for mode, sampled in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "top_k": 0})):
        tokens = []
        for m in (model, vanilla):
            torch.manual_seed(100 + rank)  # each rank its own draws, the same for both
            tokens.append(m.generate(prompts, **settings, **sampled)[:, prompts.shape[1] :].tolist())
        out[mode] = {"rtp": tokens[0], "vanilla": tokens[1]}
    return out


def rank_main(args) -> None:
    """One rank under torchrun: every variant, then generate; writes OUT/rank-R.json."""
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    before = dist.is_initialized()
    results: dict = {"world_started_before_hf_rtp": before, "variants": {}}
    for name in args.variants:
        results["variants"][name] = _variant(args.ckpt, name, device, args.steps, args.seq, args.vocab, args.out)
        if name == args.variants[0]:
            results["backend"] = str(dist.get_backend())
    results["generate"] = _generate(args.ckpt, device, args.vocab)
    with open(os.path.join(args.out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()


def judge(ranks: list[dict], steps: int) -> list[str]:
    """Every comparison of every rank, as sentences naming what failed (none: all hold)."""
    from noise_floor import judge_gradients, judge_losses

    failures = []
    for rank, result in enumerate(ranks):
        if result.get("world_started_before_hf_rtp"):
            failures.append(f"rank {rank}: a world existed before hf_rtp's from_pretrained: it did not start it")
        for name, v in result["variants"].items():
            where = f"rank {rank}, {name}"
            if not v["compared"] or v["rotated"] == 0:
                failures.append(f"{where}: nothing compared ({v['compared']} gradients, {v['rotated']} rotated)")
            if VARIANTS[name][2] and v["tiled"] == 0:
                failures.append(f"{where}: no MLP was tiled")
            if not v["checkpointing"]:
                failures.append(f"{where}: gradient checkpointing is off")
            failures += [f"{where}: {f}" for f in judge_gradients(v["grad_gaps"], v["floor"], v["bf16"])]
            losses = v["losses"]
            if len(losses["rtp"]) != steps:
                failures.append(f"{where}: {len(losses['rtp'])} steps, not {steps}")
            failures += [f"{where}: {f}" for f in judge_losses(losses["rtp"], losses["vanilla"], losses["vanilla-b"])]
            if name in HOST_STEP:
                if v["state_places"] != ["cpu"] or not v["masters"]:
                    failures.append(f"{where}: optimizer state on {v['state_places']}, {v['masters']} masters")
                if v["places"] != ["cpu"] and not v["masters_pinned"]:
                    failures.append(f"{where}: the host masters of a CUDA model are not pinned")
                if v["resumed_state_gaps"]:
                    failures.append(f"{where}: saved and loaded, the state differs at {v['resumed_state_gaps'][:5]}")
        for mode, tokens in result["generate"].items():
            if tokens["rtp"] != tokens["vanilla"]:
                failures.append(f"rank {rank}: {mode} generate gave {tokens['rtp']}, vanilla {tokens['vanilla']}")
    return failures


def report(ranks: list[dict]) -> str:
    """A line per variant: the worst gaps and their tolerances, the time it took."""
    from noise_floor import LEAST_LOSS, loss_gaps, tolerance

    lines = [f"{'variant':10} {'grad gap':>9} {'floor':>9} {'tolerance':>9} {'bf16 sum':>9} {'loss gap':>9} "
             f"{'loss floor':>10} {'loss tol':>9} {'s':>5}"]  # fmt: skip
    for name in ranks[0]["variants"]:
        vs = [r["variants"][name] for r in ranks]
        grad = max(max(v["grad_gaps"].values()) for v in vs)
        floor = max(max(v["floor"].values()) for v in vs)
        bf16 = max((max(v["bf16"].values()) for v in vs if v["bf16"]), default=float("nan"))
        loss = max(max(loss_gaps(v["losses"]["rtp"], v["losses"]["vanilla"])) for v in vs)
        own = max(max(loss_gaps(v["losses"]["vanilla-b"], v["losses"]["vanilla"])) for v in vs)
        lines.append(
            f"{name:10} {grad:9.2e} {floor:9.2e} {tolerance([floor]):9.2e} {bf16:9.2e} {loss:9.2e} {own:10.2e} "
            f"{tolerance([own], least=LEAST_LOSS):9.2e} {max(v['seconds'] for v in vs):5.1f}"
        )
    return "\n".join(lines)


def launch(args) -> int:
    """Make the checkpoint, run the ranks under torchrun, judge what they wrote."""
    import torch
    from support.models import VOCAB, make_tiny
    from support.spawn import free_port

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    if device == "cuda":
        from gpu_world import NCCL_WORLD

        if not torch.cuda.is_available():
            print("skipped: no CUDA device here")
            return SKIPPED
        if os.environ.get("HF_RTP_TEST_BACKEND") != NCCL_WORLD or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            print("skipped: hf_rtp starts NCCL itself, and two ranks share one GPU only with NCCL 2.30 or newer in its "
                  "multi-rank mode (.ci/gpu's versions stage chose the gloo world)")  # fmt: skip
            return SKIPPED
    shape = dict(SHAPES[device])
    seq = shape.pop("seq")
    os.makedirs(args.out, exist_ok=True)
    ckpt = make_tiny("llama", os.path.join(args.out, "ckpt"), **shape)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, HERE, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_RTP_TIMEOUT="120")  # fmt: skip
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
               "--master_port", str(free_port()), __file__, "--rank-run", "--device", args.device, "--out", args.out,
               "--ckpt", ckpt, "--steps", str(args.steps), "--seq", str(seq), "--vocab", str(VOCAB),
               "--variants", ",".join(args.variants)]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, env=env, timeout=args.timeout)
    print(f"torchrun of {args.nproc} ranks: exit {done.returncode} after {time.monotonic() - started:.1f} s")
    if done.returncode != 0:
        return 1
    ranks = []
    for rank in range(args.nproc):
        with open(os.path.join(args.out, f"rank-{rank}.json")) as f:
            ranks.append(json.load(f))
    failures = judge(ranks, args.steps)
    print(report(ranks))
    backend = ranks[0].get("backend")
    print(f"world started by hf_rtp: {backend}; generate greedy and sampled: "
          f"{'equal to vanilla' if not any('generate' in f for f in failures) else 'DIFFERENT'}")  # fmt: skip
    with open(os.path.join(args.out, "users-loop.json"), "w") as f:
        json.dump({"ranks": ranks, "failures": failures, "device": args.device}, f)
    for failure in failures:
        print(f"FAILED: {failure}")
    print("users' loop: " + (f"{len(failures)} comparison(s) failed" if failures else "every comparison held"))
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:0 (every rank on GPU 0, NCCL) or cpu (gloo)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", help=f"default: all ({', '.join(VARIANTS)}), on the CPU all but {CPU_SKIPS}")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.variants = (
        args.variants.split(",") if args.variants else [v for v in VARIANTS if not cpu or v not in CPU_SKIPS]
    )
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if args.rank_run:
        rank_main(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
