"""hf-rtp estimate works from config.json alone and its terms behave as the strategies do."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from hf_rtp.tools import cli, memory
from hf_rtp.tools.bench.presets import PRESETS

REPO = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


@pytest.fixture
def config_only(tmp_path):
    """A model folder with nothing but config.json: no weights to read."""
    LlamaConfig(**PRESETS["llama-90m"]).save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    return tmp_path


def test_estimate_needs_only_the_config(config_only, capsys):
    result = memory.main([str(config_only), "--world-size", "2"])
    out = capsys.readouterr().out
    # RTP with fused_loss=False beside it, and with context parallelism (each sequence cut across the ring)
    assert set(result) == set(memory.STRATEGIES) | {"rtp-unfused", "rtp-cp"}
    for strategy in result:
        assert strategy in out
    # the same answer from the config.json path and from the preset name
    assert memory.main([str(config_only / "config.json"), "--world-size", "2"]) == result
    assert memory.main(["llama-90m", "--world-size", "2"]) == result


def test_estimate_scales_with_world_size_and_optimizer(config_only):
    config = memory.load_config(str(config_only))
    states = memory.model_states_bytes(config)
    param_bytes = states / 4  # states: fp32 parameter, gradient and two AdamW moments
    one, two, four = (memory.estimate(config, n) for n in (1, 2, 4))
    assert one["rtp"] == one["single"]  # world size 1 is plain PyTorch
    assert two["ddp"] == four["ddp"] == one["ddp"]  # DDP replicates everything
    assert two["ddp"] - two["single"] == pytest.approx(param_bytes)  # its gradient buckets
    for strategy in ("fsdp2", "tp", "rtp"):
        assert one[strategy] > two[strategy] > four[strategy], strategy
    # model states shrink by 1/N: going from 2 to 4 ranks saves about states/4 for RTP
    assert two["rtp"] - four["rtp"] == pytest.approx(states / 4, rel=0.2)
    assert memory.estimate(config, 2, optimizer="sgd")["rtp"] < two["rtp"]
    assert memory.estimate(config, 2, batch=8)["rtp"] > two["rtp"]  # activations of the local batch


def test_rings_of_k_hold_what_a_flat_ring_of_k_holds_and_hsdp_what_fsdp2_over_k_holds(config_only, capsys):
    config = memory.load_config(str(config_only))
    grid, flat_two, flat_four = (
        memory.estimate(config, 4, rtp_size=2),
        memory.estimate(config, 2),
        memory.estimate(config, 4),
    )
    assert grid["rtp"] == flat_two["rtp"] > flat_four["rtp"]  # replicas do not share a chunk's memory
    assert grid["hsdp"] == flat_two["fsdp2"] > grid["fsdp2"] == flat_four["fsdp2"]
    assert "hsdp" not in flat_four  # no replicas, no HSDP line
    memory.main([str(config_only), "--world-size", "4", "--rtp-size", "2"])
    assert "4 rank(s) as 2 replicas of 2-rank rings" in capsys.readouterr().out
    for bad in ("3", "0"):
        with pytest.raises(SystemExit, match="--rtp-size must divide --world-size 4"):
            memory.main([str(config_only), "--world-size", "4", "--rtp-size", bad])


def test_smaller_rotation_pieces_need_less_pool(config_only):
    config = memory.load_config(str(config_only))
    whole = memory.estimate(config, 2, piece_bytes=10**9)["rtp"]  # the embedding's chunk in one piece
    pieces = memory.estimate(config, 2)["rtp"]
    chunk = 32000 // 2 * 768 * 4
    assert whole - pieces == pytest.approx(3 * chunk, rel=0.25)  # three slots at 2 ranks, ~16 MB each now


def test_autocast_counts_the_bf16_the_ring_and_fsdp2_carry(config_only):
    config = memory.load_config(str(config_only))
    plain, mixed = (memory.estimate(config, 2, autocast=a) for a in (False, True))
    # 16 MB pieces: the embedding's float32 lookup fills the weight slot as a float32 matmul piece did
    assert mixed["rtp"] == plain["rtp"]
    assert mixed["fsdp2"] < plain["fsdp2"]  # bf16 gathers of the root and two decoder layers
    assert mixed["ddp"] == plain["ddp"]
    # a small vocabulary and a wide MLP, chunks in one piece: the MLP's chunk sizes the weight slot,
    # in bf16 under autocast: half its float32 bytes less (one weight slot at 2 ranks)
    wide = LlamaConfig(**{**PRESETS["llama-tiny"], "vocab_size": 1000, "intermediate_size": 8192})
    plain, mixed = (memory.estimate(wide, 2, piece_bytes=10**9, autocast=a)["rtp"] for a in (False, True))
    gate_chunk = 8192 // 2 * wide.hidden_size
    assert plain - mixed == gate_chunk * 2


def test_estimate_rejects_bad_input(config_only):
    with pytest.raises(SystemExit):
        memory.main([str(config_only), "--world-size", "0"])
    with pytest.raises(SystemExit):
        memory.main([str(config_only), "--world-size", "2", "--optimizer", "lion"])
    with pytest.raises(SystemExit, match="missing: no such folder or file"):
        memory.main([str(config_only / "missing"), "--world-size", "2"])


def test_a_model_that_cannot_be_read_ends_the_command_with_one_line_naming_it(config_only, tmp_path, monkeypatch):
    """A missing path, a Hub id while HF_HUB_OFFLINE is set, a folder without config.json: one line on stderr, exit
    status 1, no traceback (it was a raw OSError from AutoConfig)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)  # as HF_HUB_OFFLINE=1 sets it at import
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "./no-such-llama": "./no-such-llama: no such folder or file",
        str(config_only / "missing"): "missing: no such folder or file",
        "some-org/some-model": "some-org/some-model is not a local folder or a bench preset, and as a Hub id its "
        "config.json is not in the local cache while HF_HUB_OFFLINE is set",
        str(empty): f"{empty} is a folder, but its config.json could not be read",
    }
    for model, said in cases.items():
        for main in (memory.main, cli.main):
            argv = ["estimate"] * (main is cli.main) + [model, "--world-size", "2"]
            with pytest.raises(SystemExit) as ended:
                main(argv)
            message = str(ended.value.code)
            assert message.startswith("hf-rtp estimate: ") and said in message, (model, message)
            assert "\n" not in message and "Traceback" not in message
    # as a command: exit status 1 and the one line on stderr
    done = subprocess.run(
        [sys.executable, "-m", "hf_rtp", "estimate", "some-org/some-model", "--world-size", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO},
        timeout=300,
    )
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "HF_HUB_OFFLINE" in done.stderr, done.stderr


@pytest.fixture
def bf16_config(tmp_path):
    """A config.json that says bfloat16, as most checkpoints on the Hub do (`dtype`, or an older `torch_dtype`)."""
    LlamaConfig(**PRESETS["llama-90m"], dtype="bfloat16").save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_the_estimate_counts_in_the_config_s_dtype_unless_told_and_says_which(bf16_config, key, capsys):
    path = bf16_config / "config.json"
    stored = json.loads(path.read_text())
    stored[key] = stored.pop("dtype")
    path.write_text(json.dumps(stored))
    config = memory.load_config(str(bf16_config))
    argv = [str(bf16_config), "--world-size", "2"]
    # as from_pretrained(dtype="auto") loads it: bfloat16, half the float32 model states
    assert memory.main(argv) == memory.estimate(config, 2, dtype=torch.bfloat16, device="cuda")
    assert "in bfloat16 (the config's dtype)" in capsys.readouterr().out
    assert memory.model_states_bytes(config) * 2 == memory.model_states_bytes(config, "float32")
    assert memory.main([*argv, "--dtype", "auto"]) == memory.main(argv)
    capsys.readouterr()
    assert memory.main([*argv, "--dtype", "fp32"]) == memory.estimate(config, 2, dtype=torch.float32, device="cuda")
    assert "in float32 (as asked)" in capsys.readouterr().out
    # a config naming no dtype: float32, and the output says the config named none
    memory.main(["llama-90m", "--world-size", "2"])
    assert "in float32 (the config names no dtype" in capsys.readouterr().out
    from hf_rtp.tools.memory_qlora import estimate_qlora
    from hf_rtp.tools.memory_qlora import main as qlora

    four_bit = [*argv, "--load-in-4bit", "--device", "cpu"]
    assert qlora(four_bit) == estimate_qlora(config, 2, dtype=torch.bfloat16)
    assert "unquantized weights in bfloat16 (the config's dtype)" in capsys.readouterr().out
    assert qlora([*four_bit, "--dtype", "float32"]) == estimate_qlora(config, 2, dtype=torch.float32)


def test_dtypes_are_taken_as_transformers_users_type_them_or_refused_with_the_usage(config_only, capsys):
    config = memory.load_config(str(config_only))
    argv = [str(config_only), "--world-size", "2", "--device", "cpu"]
    for typed, dtype in {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "BF16": torch.bfloat16,
        "torch.bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
    }.items():
        assert memory.main([*argv, "--dtype", typed]) == memory.estimate(config, 2, dtype=dtype), typed
        assert memory.estimate(config, 2, dtype=typed) == memory.estimate(config, 2, dtype=dtype), typed
    capsys.readouterr()
    for typed in ("int8", "bf", "float8_e4m3fn", "nonsense"):
        for main in (memory.main, cli.main):
            with pytest.raises(SystemExit) as refused:
                main(["estimate"] * (main is cli.main) + [*argv, "--dtype", typed])
            assert refused.value.code == 2, typed  # argparse's usage error, not an AttributeError
            err = capsys.readouterr().err
            assert err.startswith("usage: hf-rtp estimate") and f"argument --dtype: {typed!r} is not a dtype" in err
            assert "auto (the config's dtype" in err and "bfloat16, bf16, float16, fp16" in err, err
        with pytest.raises(ValueError, match="is not a dtype hf-rtp knows; one of auto"):
            memory.estimate(config, 2, dtype=typed)
    # hf-rtp bench takes the same names, kept as torch names them (its workers' getattr(torch, ...))
    from hf_rtp.tools.bench import options

    assert options.parser().parse_args(["--dtype", "bf16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit) as refused:
        options.parser().parse_args(["--dtype", "int8"])
    assert refused.value.code == 2 and "argument --dtype: 'int8' is not a dtype" in capsys.readouterr().err


def test_results_are_json_serialisable(config_only):
    json.dumps(memory.estimate(memory.load_config(str(config_only)), 3))


def test_architecture_without_a_plan_is_estimated_with_the_automatic_plan():
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    one, two = memory.estimate(config, 1), memory.estimate(config, 2)
    assert two["rtp"] < one["rtp"] == one["single"]


STORED = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "results")
STORED_RUNS = [(path, json.loads(Path(path).read_text())) for path in sorted(glob.glob(os.path.join(STORED, "*.json")))]
# this project's CPU bench runs, which set the CPU terms (a GPU run's results would be checked against CUDA's)
ON_CPU = [(path, run) for path, run in STORED_RUNS if "results" in run and run["settings"].get("device") == "cpu"]
RESULTS = [
    path for path, run in ON_CPU if not run["settings"].get("load_in_4bit")
]  # not the --budget-gb runs, nor QLoRA's (--load-in-4bit): checked against estimate_qlora below
QLORA_RESULTS = [path for path, run in ON_CPU if run["settings"].get("load_in_4bit")]


def test_the_stored_bench_results_are_found():
    """The checks below are parametrized by the stored results: finding none would skip them without a word."""
    assert len(RESULTS) >= 5 and len(QLORA_RESULTS) >= 2, STORED


@pytest.mark.parametrize("path", RESULTS, ids=os.path.basename)
def test_estimate_is_within_15_percent_of_every_measured_strategy(path):
    """`hf-rtp bench` results of this project's CPU machine, from batch 2x128 with a 32k vocabulary to
    1x2048 with 128k, with and without gradient checkpointing, RTP with and without the fused loss.
    The estimate's terms were set on the 2x128 and 1x1024 shapes; 1x2048 and gradient checkpointing
    were measured afterwards and not used to set them."""
    result = json.loads(Path(path).read_text())
    settings = result["settings"]
    config = memory.load_config(settings["preset"])
    checked = 0
    for row in result["results"]:
        grid = row["strategy"] == "rtp-2d"  # RTP as rings of rtp_size ranks
        estimates = memory.estimate(
            config,
            row["world_size"],
            batch=settings["batch"],
            seq=row.get("seq", settings["seq"]),  # --long-sequence's rtp-cp-same-tokens: N x --seq
            dtype=settings["dtype"],
            gradient_checkpointing=settings.get("gradient_checkpointing", False),
            rtp_size=row["rtp_size"] if grid else None,
            device="cpu",  # host memory on this project's CPU machine, as measured
            tiled_mlp=memory.tiled_setting(str(settings.get("tiled_mlp", "auto"))),  # runs before it: the default
        )
        strategy = "rtp" if grid else "rtp-cp" if row["strategy"] == "rtp-cp-same-tokens" else row["strategy"]
        if strategy in estimates:  # not the zero-loss run, which only measures the loss's share
            assert estimates[strategy] / 1e9 == pytest.approx(row["peak_gb"], rel=0.15), row["strategy"]
            checked += 1
    assert checked >= min(5, len(result["results"]))  # every strategy of a run of a few (the 2x2 before/after)


# estimate / measured VmRSS peak on the 90M preset (docs/benchmarks.md, "QLoRA"): DDP's measured peak carries
# ~0.17 GB of checkpoint pages vanilla's 4-bit load leaves mapped, which no device holds; RTP's estimate counts
# fixed per-step buffers (three 16 MB loss blocks, a 16 MB ring slot, 35 MB of runtime) that the measured peak
# does not show all at once. Both weigh little beside a real model's states and activations.
QLORA_BANDS = {"ddp": (0.75, 0.9), "fsdp2": (0.9, 1.1), "rtp": (1.1, 1.35)}


@pytest.mark.parametrize("path", QLORA_RESULTS, ids=os.path.basename)
def test_the_qlora_estimate_stays_in_its_measured_band_for_every_strategy(path):
    """`hf-rtp bench --load-in-4bit` (NF4 with double quantization, LoRA r=16 on every linear layer) on the
    90M preset at 2 and 4 ranks: DDP, FSDP2 as FSDP-QLoRA runs it, and RTP, in the order measured."""
    from hf_rtp.tools.memory_qlora import estimate_qlora

    result = json.loads(Path(path).read_text())
    settings = result["settings"]
    config = memory.load_config(settings["preset"])
    estimated, measured = {}, {}
    for row in result["results"]:
        estimates = estimate_qlora(
            config,
            row["world_size"],
            batch=settings["batch"],
            seq=settings["seq"],
            gradient_checkpointing=settings["gradient_checkpointing"],
            dtype=settings["dtype"],
            device="cpu",
        )
        estimated[row["strategy"]], measured[row["strategy"]] = estimates[row["strategy"]] / 1e9, row["peak_gb"]
        low, high = QLORA_BANDS[row["strategy"]]
        assert low <= estimated[row["strategy"]] / row["peak_gb"] <= high, (row["strategy"], estimated, measured)
    assert set(estimated) == {"ddp", "fsdp2", "rtp"}
    assert min(estimated, key=estimated.__getitem__) == min(measured, key=measured.__getitem__) == "rtp"


def test_the_fsdp_qlora_estimate_matches_peft_s_published_70b_run():
    """The one GPU measurement at hand: PEFT's FSDP-QLoRA of Llama-2-70B on 2 GPUs took 35.6 GB per GPU
    (docs/source/accelerate/fsdp.md of PEFT) in the setting PUBLISHED spells out; estimated with CUDA's terms, 11%
    below it (docs/benchmarks.md says why the bound is 15%: what that run held beyond its tensors is not known)."""
    from hf_rtp.tools.memory_qlora import PUBLISHED, PUBLISHED_FSDP_QLORA_GB, estimate_qlora, llama2_70b

    config = llama2_70b()
    memory.set_attention_implementation(config, "sdpa")
    estimate = estimate_qlora(config, 2, **PUBLISHED, device="cuda")["fsdp2"] / 1e9  # type: ignore[arg-type]
    assert estimate == pytest.approx(PUBLISHED_FSDP_QLORA_GB, rel=0.15)


def test_the_qlora_estimate_shards_what_each_strategy_shards(config_only, capsys):
    from hf_rtp.tools.memory_qlora import estimate_qlora

    config = memory.load_config(str(config_only))
    two, four, eight = (estimate_qlora(config, n) for n in (2, 4, 8))
    assert two["ddp"] == four["ddp"] == eight["ddp"]  # DDP replicates the base
    for n, e in ((2, two), (4, four), (8, eight)):
        assert e["rtp"] < min(e["fsdp2"], e["ddp"]), n  # FSDP2 gathers whole layers, the root and the logits
    # the quantization state: whole on every FSDP-QLoRA rank, sharded with its rows on RTP's, where each rank keeps
    # its scales as float32 (double quantization dequantized at load): double quantization saves FSDP2 the same
    # bytes at every world size and RTP none
    for n in (2, 4, 8):
        plain, double = estimate_qlora(config, n, double_quant=False), estimate_qlora(config, n)
        assert plain["fsdp2"] - double["fsdp2"] > 0 and plain["rtp"] == double["rtp"], n
    assert estimate_qlora(config, 2, lora_rank=64)["rtp"] > two["rtp"]  # bigger adapters, replicated
    from hf_rtp.tools.memory_qlora import main

    printed = main([str(config_only), "--world-size", "2", "--load-in-4bit", "--device", "cpu"])
    assert printed == two and "QLoRA (NF4 base, LoRA r=16" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--load-in-4bit estimates one flat ring"):
        main([str(config_only), "--world-size", "4", "--rtp-size", "2", "--load-in-4bit"])
    assert main([str(config_only), "--world-size", "2"]) == memory.main([str(config_only), "--world-size", "2"])


def test_the_qlora_estimate_counts_tiling_and_offload_in_the_rtp_row_alone(config_only, capsys):
    """QLoRA at a long sequence: from_pretrained's tiled_mlp ("auto" tiles above 16384 tokens per rank) and hf_rtp's
    checkpoint offload lower the RTP row, as memory.estimate counts them; DDP's and FSDP-QLoRA's rows run whole."""
    from hf_rtp.tools.memory_qlora import estimate_qlora, main

    config = memory.load_config(str(config_only))
    long = dict(batch=1, seq=32768, gradient_checkpointing=True)
    whole, tiled = (estimate_qlora(config, 2, **long, tiled_mlp=t) for t in (False, "auto"))
    offloaded = estimate_qlora(config, 2, **long, checkpoint_offload=True)
    for strategy in ("ddp", "fsdp2"):
        assert whole[strategy] == tiled[strategy] == offloaded[strategy], strategy
    assert offloaded["rtp"] < tiled["rtp"] < whole["rtp"]
    inputs = memory.checkpointed_inputs(memory._meta_model(config, torch.float32), 1, 32768)
    layers = config.num_hidden_layers
    assert tiled["rtp"] - offloaded["rtp"] == pytest.approx(inputs * (layers - 2) / layers)  # all but two inputs
    short = [estimate_qlora(config, 2, batch=1, seq=2048, tiled_mlp=t)["rtp"] for t in (False, "auto")]
    assert short[0] == short[1]
    argv = [str(config_only), "--world-size", "2", "--load-in-4bit", "--seq", "32768", "--batch", "1"]
    assert main([*argv, "--gradient-checkpointing", "--checkpoint-offload", "--device", "cpu"]) == offloaded
    assert "pinned host memory per node of 2 GPUs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="add --gradient-checkpointing"):
        main([*argv, "--checkpoint-offload"])


def test_context_parallelism_divides_the_activations_not_the_model_states(config_only):
    """Each rank holds 1/N of a sequence's tokens: at a long sequence the peak falls toward the model states / N
    plus the activations / N, and a ring of one has no context-parallel row (its sequence is whole)."""
    config = memory.load_config(str(config_only))
    assert "rtp-cp" not in memory.estimate(config, 1)
    short, long = (memory.estimate(config, 2, batch=1, seq=s) for s in (256, 8192))
    activations = long["rtp"] - short["rtp"]  # what 31x more tokens cost RTP, every one on each rank
    assert long["rtp-cp"] - short["rtp-cp"] == pytest.approx(activations / 2, rel=0.15)
    assert memory.estimate(config, 4, batch=1, seq=8192)["rtp-cp"] < long["rtp-cp"]


def test_a_cuda_estimate_counts_the_cuda_tile_and_what_a_cuda_process_holds_beyond_its_tensors():
    """On CUDA the fused loss's tile is the one layers/fused_loss.py picks there (256 MiB, not the CPU's 16), and
    each rank's process holds its CUDA context, cuBLAS's workspaces and the allocator's segments, plus NCCL's
    buffers per process group its strategy talks on: none for one process, one for DDP and FSDP2, two for RTP
    (the ring and its mesh). The CPU estimate holds none of these."""
    from hf_rtp.layers.fused_loss import block_bytes

    assert memory.CUDA.loss_tile == block_bytes(torch.device("cuda")) == 256 * 2**20
    assert memory.CPU.loss_tile == block_bytes(torch.device("cpu")) == 16 * 2**20
    config = LlamaConfig(**PRESETS["llama-128k"])  # at 1x4096 a rank's logits exceed three CUDA tiles
    cpu, cuda = (memory.estimate(config, 2, batch=1, seq=4096, device=d) for d in ("cpu", "cuda"))
    beside = memory.CUDA.in_allocator - memory.CPU.in_allocator + memory.CUDA.context
    group = memory.CUDA.per_group
    assert cuda["single"] - cpu["single"] == pytest.approx(beside)
    for strategy in ("ddp", "fsdp2", "tp"):
        assert cuda[strategy] - cpu[strategy] == pytest.approx(beside + group), strategy
    assert cuda["rtp-unfused"] - cpu["rtp-unfused"] == pytest.approx(beside + 2 * group)
    tiles = 3 * (memory.CUDA.loss_tile - memory.CPU.loss_tile)  # the fused loss holds three tiles at its peak
    assert cuda["rtp"] - cpu["rtp"] == pytest.approx(beside + 2 * group + tiles)
    # rings of 2 with replicas talk on the replicas' group too; what torch's counters miss is named apart
    grid = memory.estimate(config, 4, batch=1, seq=4096, rtp_size=2, device="cuda")
    assert memory.outside_allocator("rtp", 4, "cuda", rtp_size=2) == memory.CUDA.context + 3 * group
    assert grid["rtp"] - memory.outside_allocator("rtp", 4, "cuda", rtp_size=2) == pytest.approx(
        cuda["rtp"] - memory.outside_allocator("rtp", 2, "cuda")
    )
    # QLoRA alike: DDP's one group, RTP's two
    from hf_rtp.tools.memory_qlora import estimate_qlora

    small = LlamaConfig(**PRESETS["llama-tiny"])
    q_cpu, q_cuda = (estimate_qlora(small, 2, device=d) for d in ("cpu", "cuda"))
    assert q_cuda["ddp"] - q_cpu["ddp"] == pytest.approx(beside + group)
    assert q_cuda["rtp"] - q_cpu["rtp"] >= beside + 2 * group


def test_the_cpu_terms_are_the_ones_the_cpu_bench_measured_and_nothing_is_held_outside_them(config_only, capsys):
    assert memory.device_terms("cpu") is memory.CPU and memory.device_terms("cuda:1") is memory.CUDA
    assert memory.CPU.in_allocator == memory.RUNTIME_BYTES and memory.CPU.context == memory.CPU.per_group == 0
    for strategy in (*memory.STRATEGIES, "rtp-unfused", "rtp-cp", "hsdp"):
        assert memory.outside_allocator(strategy, 4, "cpu", rtp_size=2) == 0
    assert memory.outside_allocator("rtp", 1, "cuda") == memory.CUDA.context  # world size 1: no process group
    with pytest.raises(ValueError, match="knows the devices cpu, cuda, not 'mps'"):
        memory.estimate(memory.load_config(str(config_only)), 2, device="mps")
    # the command estimates for GPUs unless told otherwise, and says what its figures hold
    config = memory.load_config(str(config_only))
    assert memory.main([str(config_only), "--world-size", "2"]) == memory.estimate(config, 2, device="cuda")
    assert "CUDA context" in capsys.readouterr().out
    assert memory.main([str(config_only), "--world-size", "2", "--device", "cpu"]) == memory.estimate(config, 2)
    assert "on a CPU: host memory" in capsys.readouterr().out


def test_tiled_mlps_lower_the_rtp_rows_alone_and_only_where_they_tile():
    """from_pretrained's tiled_mlp in the estimate: below its threshold every row is the untiled one; above it the
    RTP rows lose the MLPs' intermediates but one tile's (the stored 4096-token runs, tiled and not, measure it)."""
    config = memory.load_config("llama-small")
    short = [memory.estimate(config, 2, batch=1, seq=2048, tiled_mlp=t) for t in ("auto", False)]
    assert short[0] == short[1]  # "auto" tiles above 16384 tokens per rank
    whole, tiled = (memory.estimate(config, 2, batch=1, seq=4096, tiled_mlp=t) for t in (False, 512))
    for strategy in ("single", "ddp", "fsdp2", "tp"):
        assert tiled[strategy] == whole[strategy], strategy
    for strategy in ("rtp", "rtp-unfused", "rtp-cp"):
        assert tiled[strategy] < 0.85 * whole[strategy], strategy


def test_with_checkpointing_the_final_norm_outside_the_layers_is_counted_tiled(config_only):
    """Under gradient checkpointing what lies outside the decoder layers is kept whole for backward, the final norm
    among them: tiled, it keeps its input's tiles, not its float32 copies of a bf16 input."""
    config = memory.load_config(str(config_only))
    model = memory._meta_model(config, torch.bfloat16)
    tokens, tile = 4096, 512
    whole = memory.saved_activation_bytes(model, 1, tokens, False, gradient_checkpointing=True)
    tiled = memory._tiled_trace(model, 1, tokens, False, tile, gradient_checkpointing=True)
    assert whole - tiled >= tokens * config.hidden_size * 4  # at least one float32 copy of every token
    layers = config.num_hidden_layers
    full = memory._tiled_trace(model, 1, tokens, False, tile)
    working = (memory.saved_activation_bytes(model, 1, tokens, False) - full) / (layers * tokens) * tile
    expected = tiled + (full - tiled) / layers + working
    assert memory._activations(model, 1, tokens, False, True, tile) == pytest.approx(expected)
    assert not any("forward" in vars(m) for m in model.modules())  # the estimate leaves its model as it was
