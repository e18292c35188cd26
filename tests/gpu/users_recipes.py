"""The recipes users launch, launched as they launch them, beside the same recipe on plain transformers and DDP in
the same call (.ci/gpu's recipes and trl stages; docs/testing.md, "On a GPU").

- finetune: `accelerate launch` of recipes/finetune.py (accelerate's loop, hf_rtp.Accelerator), and of the same
  recipe with `--vanilla` (plain transformers, accelerate's own Accelerator, DDP);
- trainer: `accelerate launch` of recipes/trainer_sft.py (plain transformers.Trainer on hf_rtp's model), and with
  `--vanilla`;
- trl: `accelerate launch` of TRL's own `trl/scripts/sft.py` as the installed TRL ships it (SFTTrainer, full
  fine-tuning, TRL's defaults: bf16 and gradient checkpointing on a GPU), and of a copy whose model line is hf_rtp's
  one line (docs/integrations.md).

On a GPU with recipes/configs/gpu.yaml (NCCL, bf16 mixed precision), two ranks sharing GPU 0 (tests/gpu/one_gpu.py
says why every rank is then its node's local rank 0); on the CPU with recipes/configs/cpu.yaml (gloo, float32). The
same model, tokenizer and data for both runs of a pair (recipes/defaults.py's), at least 20 optimizer steps. Compared:
each step's loss and, where the run logs it, its gradient norm (a sum over ranks left undivided doubles it, where
Adam's steps would hide it), the evaluation loss where the recipe computes one, and the saved checkpoint: vanilla
transformers loads hf_rtp's with nothing missing, unexpected or resized, and its loss on held-out blocks is the
vanilla run's checkpoint's.

Tolerances (relative): float32, 1e-4 at every step (chunked sums in float32, ~1e-6, and what 20 Adam steps make of
them); bf16, 1e-2 at the first step (one bf16 rounding of the same forward) and 5e-2 at later ones, where the
difference of the two runs' bf16 roundings compounds. These launches check the wiring (devices, processes, DDP's
mean, the saves); tests/gpu/users_loop.py checks the numbers against a measured noise floor.

    python tests/gpu/users_recipes.py --device cuda --out DIR --only finetune,trainer
    python tests/gpu/users_recipes.py --device cpu --out DIR              # the same on the CPU over gloo (CI)

Exits 0 when every comparison holds, 1 when one does not, 77 when it cannot run here (no CUDA, no NCCL that lets two
ranks share the GPU, or TRL missing for `--only trl`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
for path in (HERE, TESTS, ROOT, os.path.join(ROOT, "recipes")):
    if path not in sys.path:
        sys.path.insert(0, path)

SKIPPED = 77
STEPS = 20
RECIPES = ("finetune", "trainer", "trl")
TOLERANCE = {  # relative: (first step, later steps)
    "float32": (1e-4, 1e-4),
    "bf16": (1e-2, 5e-2),
}
SHIPPED = "        model=model_args.model_name_or_path,\n"
ONE_LINE = (
    "        model=hf_rtp.from_pretrained(model_args.model_name_or_path, **training_args.model_init_kwargs, "
    "quantization_config=get_quantization_config(model_args)),\n"
)


def trl_script(folder: str, rotated: bool) -> str:
    """TRL's sft.py copied into `folder`, as shipped or with hf_rtp's one line for its model."""
    import trl

    with open(os.path.join(os.path.dirname(trl.__file__), "scripts", "sft.py")) as f:
        text = f.read()
    if text.count(SHIPPED) != 1:
        raise SystemExit("TRL's sft.py no longer passes model=model_args.model_name_or_path: update ONE_LINE")
    if rotated:
        text = text.replace(SHIPPED, ONE_LINE)
        text = text.replace("    import transformers\n", "    import hf_rtp\n    import transformers\n", 1)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sft.py")
    with open(path, "w") as f:
        f.write(text)
    return path


def compare(
    name: str, mine: list[float], theirs: list[float], tolerance: tuple[float, float], least: int = STEPS
) -> list[str]:
    """Step by step, `mine` within `tolerance` (relative: the first step's, then the later ones') of `theirs`, which
    holds at least `least` steps."""
    if len(mine) != len(theirs) or len(theirs) < least:
        return [f"{name}: {len(mine)} values against vanilla's {len(theirs)} (at least {least} wanted)"]
    failures = []
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True), start=1):
        limit = tolerance[0] if step == 1 else tolerance[1]
        if not abs(a - b) <= limit * abs(b):
            failures.append(f"{name} at step {step}: {a:.6g} against vanilla's {b:.6g} (relative {limit:g} allowed)")
    return failures


def _launch(command: list[str], env: dict, log: str, timeout: float, done: str, hang_allowed: bool) -> int | str:
    """Run a launcher to its end: its exit code, or "hung at exit" where `hang_allowed` and its ranks wrote `done`
    but were still there 20 s later (vanilla TRL's gloo teardown hangs now and then: test_trl_sft_script.py)."""
    from support.spawn import kill_launcher

    with open(log, "w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    started, finished = time.monotonic(), None
    try:
        while time.monotonic() - started < timeout:
            code = proc.poll()
            if code is not None:
                return code
            if finished is None and os.path.exists(done):
                finished = time.monotonic()
            if hang_allowed and finished is not None and time.monotonic() - finished > 20:
                return "hung at exit"
            time.sleep(0.5)
        return f"timeout ({timeout:.0f} s)"
    finally:
        if proc.poll() is None:
            kill_launcher(proc)


def _held_out(blocks_file: str, tokenizer_dir: str, seq_len: int):
    """A few blocks of the held-out texts, as the recipes pack them."""
    from packing import load_texts, pack
    from transformers import AutoTokenizer

    return pack(load_texts(blocks_file), AutoTokenizer.from_pretrained(tokenizer_dir), seq_len)[:8]


def _saved_like_vanilla(name: str, rotated_dir: str, vanilla_dir: str, blocks, tolerance: float) -> list[str]:
    """hf_rtp's saved model as vanilla transformers loads it: nothing missing, unexpected or resized, the vanilla
    run's keys, and its loss on `blocks` within `tolerance` of the vanilla run's saved model."""
    import torch
    from transformers import AutoModelForCausalLM

    failures = []
    loaded, info = AutoModelForCausalLM.from_pretrained(rotated_dir, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        failures.append(f"{name}: vanilla transformers loads hf_rtp's checkpoint with {problems}")
    vanilla = AutoModelForCausalLM.from_pretrained(vanilla_dir, dtype=torch.float32)
    if list(loaded.state_dict()) != list(vanilla.state_dict()):
        failures.append(f"{name}: the saved tensors' names differ from the vanilla run's")
    with torch.no_grad():
        losses = [m.eval()(input_ids=blocks, labels=blocks).loss.item() for m in (loaded, vanilla)]
    if not abs(losses[0] - losses[1]) <= tolerance * abs(losses[1]):
        failures.append(f"{name}: the saved model's loss {losses[0]:.6g} against vanilla's saved {losses[1]:.6g}")
    return failures


def run_pair(recipe: str, args, default: tuple[str, str, str], env: dict) -> tuple[list[str], dict]:
    """Launch `recipe` with hf_rtp and on plain transformers; compare. (failures, what was measured)."""
    from support.spawn import free_port

    model, train, held_out = default
    dtype = "bf16" if args.device == "cuda" else "float32"
    tolerance = TOLERANCE[dtype]
    config = os.path.join(ROOT, "recipes", "configs", "gpu.yaml" if args.device == "cuda" else "cpu.yaml")
    out, measured, failures = {}, {}, []
    for which in ("rtp", "vanilla"):
        folder = os.path.join(args.out, f"{recipe}-{which}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        if recipe == "finetune":
            script = os.path.join(ROOT, "recipes", "finetune.py")
            extra = ["--model", model, "--dataset", train, "--eval_dataset", held_out, "--output_dir", folder,
                     "--max_steps", str(STEPS), "--eval_every", str(STEPS)]  # fmt: skip
            done = os.path.join(folder, "final", "config.json")
        elif recipe == "trainer":
            script = os.path.join(ROOT, "recipes", "trainer_sft.py")
            extra = ["--model", model, "--dataset", train, "--output_dir", folder, "--max_steps", str(STEPS)]
            done = os.path.join(folder, "summary.json")
        else:
            script = trl_script(os.path.join(folder, "script"), rotated=which == "rtp")
            data = os.path.join(args.out, "trl-data")
            os.makedirs(data, exist_ok=True)
            shutil.copy(train, os.path.join(data, "train.jsonl"))
            extra = ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", folder,
                     "--report_to", "none", "--logging_steps", "1", "--max_steps", str(STEPS),
                     "--per_device_train_batch_size", "4", "--max_length", "64", "--learning_rate", "1e-3",
                     "--seed", "0", "--save_steps", str(STEPS)]  # fmt: skip
            extra += [] if args.device == "cuda" else ["--use_cpu", "--bf16", "false"]
            done = os.path.join(folder, "model.safetensors")
        if which == "vanilla" and recipe != "trl":
            extra.append("--vanilla")
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        launcher += ["--num_processes", "2", "--main_process_port", str(free_port())]
        command = [*launcher, os.path.join(HERE, "one_gpu.py"), script, *extra]
        started = time.monotonic()
        log = os.path.join(args.out, f"{recipe}-{which}.log")
        code = _launch(command, env, log, args.timeout, done, hang_allowed=which == "vanilla" and recipe == "trl")
        seconds = time.monotonic() - started
        print(f"{recipe} ({which}): {code} after {seconds:.1f} s; log {log}", flush=True)
        measured[f"{which}_s"] = round(seconds, 1)
        if code not in (0, "hung at exit"):
            with open(log, errors="replace") as f:
                print(f.read()[-4000:])
            return [f"{recipe} ({which}) did not finish: {code}"], measured
        out[which] = folder
    rotated, vanilla = (_read(recipe, out[w]) for w in ("rtp", "vanilla"))
    for key in rotated:
        least = 1 if key == "eval_loss" else STEPS  # evaluated once, after the last step
        failures += compare(f"{recipe} {key}", rotated[key], vanilla[key], tolerance, least)
        measured[f"largest {key} gap"] = max(
            (abs(a - b) / abs(b) for a, b in zip(rotated[key], vanilla[key], strict=False) if b), default=None
        )
    if recipe == "trainer" and not all(_summary(out[w])["replicated_identical"] for w in out):
        failures.append("trainer: DDP left the ranks' replicated parameters different")
    saved = {"finetune": "final", "trainer": "final", "trl": ""}[recipe]
    blocks = _held_out(held_out, model, 64)
    failures += _saved_like_vanilla(
        recipe, os.path.join(out["rtp"], saved), os.path.join(out["vanilla"], saved), blocks, tolerance[1]
    )
    return failures, measured


def _summary(folder: str) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def _read(recipe: str, folder: str) -> dict[str, list[float]]:
    """{quantity: its value at every step} a run logged."""
    if recipe == "finetune":
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        read = {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}
        read["eval_loss"] = [r["eval_loss"] for r in rows if "eval_loss" in r]
        return read
    if recipe == "trainer":
        log = _summary(folder)["log"]
    else:
        with open(os.path.join(folder, f"checkpoint-{STEPS}", "trainer_state.json")) as f:
            log = [e for e in json.load(f)["log_history"] if "loss" in e]
    return {"loss": [e["loss"] for e in log], "grad_norm": [e["grad_norm"] for e in log]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=",".join(RECIPES))
    p.add_argument("--timeout", type=float, default=240, help="seconds one launch may take")
    args = p.parse_args(argv)
    recipes = args.only.split(",")
    if set(recipes) - set(RECIPES):
        p.error(f"--only takes {', '.join(RECIPES)}")
    import importlib.util

    import torch

    if args.device == "cuda":
        from gpu_world import NCCL_WORLD

        if not torch.cuda.is_available():
            print("skipped: no CUDA device here")
            return SKIPPED
        if torch.cuda.device_count() < 2 and (
            os.environ.get("HF_RTP_TEST_BACKEND") != NCCL_WORLD or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1"
        ):
            print("skipped: two ranks share one GPU over NCCL only with NCCL 2.30 or newer in its multi-rank mode "
                  "(.ci/gpu's versions stage chose the gloo world)")  # fmt: skip
            return SKIPPED
    if "trl" in recipes and importlib.util.find_spec("trl") is None:
        recipes.remove("trl")
        print("TRL is not installed here (.ci/gpu-prepare carries its wheel): its pair is not run")
        if not recipes:
            return SKIPPED
    from defaults import make_default

    os.makedirs(args.out, exist_ok=True)
    default = make_default(os.path.join(args.out, "default"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", HF_RTP_TIMEOUT="120")  # fmt: skip
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    failures, measured = [], {}
    for recipe in recipes:
        found, measured[recipe] = run_pair(recipe, args, default, env)
        failures += found
        print(f"{recipe}: " + ("as vanilla" if not found else f"{len(found)} difference(s)") + f" {measured[recipe]}")
    with open(os.path.join(args.out, "users-recipes.json"), "w") as f:
        json.dump({"device": args.device, "measured": measured, "failures": failures}, f, indent=1)
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"launched recipes ({', '.join(recipes)}): " + (f"{len(failures)} failed" if failures else "as vanilla"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
