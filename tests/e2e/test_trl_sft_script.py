"""TRL's own `trl/scripts/sft.py`, as the installed TRL ships it, at 2 CPU ranks with `--load_in_4bit --use_peft`
(QLoRA): once as shipped, and once copied with its model line changed to hf_rtp's one line (docs/integrations.md),
which carries every model keyword the script builds. Losses equal vanilla's; the adapter loads onto vanilla's own
4-bit base with the logits of the vanilla run's adapter. The repository holds no copy of TRL's script.

Left out of hf_rtp.from_pretrained, the quantization config would leave a silently different (unquantized) base:
such a line is refused by name at the trainer's construction (tests/distributed/test_trl.py).

No evaluation: on a CPU with AVX512-BF16, vanilla bitsandbytes' eval forward repacks its 4-bit weights for a bf16
kernel that then also runs in training (tests/support/compare.py, vanilla_training_path)."""

import json
import os
import subprocess
import time

import pytest
import torch
from support.models import global_batch, make_tiny, tiny_tokenizer
from support.recipes import ENV, torchrun
from support.spawn import free_port, kill_launcher

trl = pytest.importorskip("trl")
pytest.importorskip("bitsandbytes")

SHIPPED = "        model=model_args.model_name_or_path,\n"
ONE_LINE = (
    "        model=hf_rtp.from_pretrained(model_args.model_name_or_path, **training_args.model_init_kwargs, "
    "quantization_config=get_quantization_config(model_args)),\n"
)
STEPS = 4


def _script(folder, model_line):
    """TRL's sft.py, copied into `folder`, with its model line (and an import) changed; or as shipped."""
    shipped = os.path.join(os.path.dirname(trl.__file__), "scripts", "sft.py")
    with open(shipped) as f:
        text = f.read()
    assert text.count(SHIPPED) == 1, "TRL's sft.py no longer passes model=model_args.model_name_or_path"
    if model_line is not None:
        text = text.replace(SHIPPED, model_line).replace(
            "    import transformers\n", "    import hf_rtp\n    import transformers\n", 1
        )
    os.makedirs(folder)
    path = os.path.join(folder, "sft.py")
    with open(path, "w") as f:
        f.write(text)
    return path


def _data(folder):
    """A text dataset in a local folder, as `--dataset_name` loads it offline."""
    os.makedirs(folder)
    rows = global_batch(32, seq=24, seed=7).reshape(-1, 24).tolist()
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for ids in rows:
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")
    return folder


def _run(script, ckpt, data, out, hang_at_exit_allowed):
    """Launch `script` on 2 ranks; (exit code, output). With `hang_at_exit_allowed`, a launch whose ranks finished
    (the adapter saved, the script's last step) but are still there 20 s later is reaped and reported as "hung at
    exit": vanilla TRL's sft.py hangs there now and then (2 runs in 6 here), a rank in gloo's process-group
    destructor after `trainer.end()`; the test compares what it wrote. hf_rtp's run must exit."""
    command = [*torchrun(2), "--master_port", str(free_port()), script, "--model_name_or_path", ckpt,
               "--dataset_name", data, "--output_dir", out, "--use_cpu", "--report_to", "none",
               "--logging_steps", "1", "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
               "--max_length", "24", "--learning_rate", "1e-3", "--seed", "0", "--save_steps", str(STEPS),
               "--use_peft", "--load_in_4bit", "--lora_r", "4", "--lora_target_modules", "all-linear"]  # fmt: skip
    log = f"{out}.log"
    with open(log, "w") as sink:  # a file, not a pipe: nobody reads while the ranks run
        proc = subprocess.Popen(command, env=ENV, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    code: int | str | None = None
    try:
        saved = None
        for _ in range(300):
            code = proc.poll()
            if code is not None:
                break
            if saved is None and os.path.exists(os.path.join(out, "adapter_model.safetensors")):
                saved = time.monotonic()
            if hang_at_exit_allowed and saved is not None and time.monotonic() - saved > 20:
                code = "hung at exit"
                break
            time.sleep(1)
    finally:
        if proc.poll() is None:
            kill_launcher(proc)
    with open(log, errors="replace") as f:
        return code, f.read()


def _losses(out):
    with open(os.path.join(out, f"checkpoint-{STEPS}", "trainer_state.json")) as f:
        return [e["loss"] for e in json.load(f)["log_history"] if "loss" in e]


def _served(base_ckpt, adapter):
    """Logits of `adapter` on vanilla's own 4-bit base (vanilla's training path, compare.py)."""
    from peft import PeftModel
    from support.compare import vanilla_training_path
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = AutoModelForCausalLM.from_pretrained(
        base_ckpt, dtype=torch.float32, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                                            bnb_4bit_compute_dtype=torch.float32)
    )  # fmt: skip
    model = PeftModel.from_pretrained(vanilla_training_path(base), adapter).eval()
    with torch.no_grad():
        return model(input_ids=global_batch(1, seq=12)[0]).logits


def test_trl_sft_script_qlora_with_hf_rtps_one_line_trains_as_vanilla(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", hidden_size=64, intermediate_size=128, head_dim=16)
    tiny_tokenizer().save_pretrained(ckpt)  # sft.py loads the processing class from the model's folder
    data = _data(str(tmp_path / "data"))
    runs = {"vanilla": None, "rtp": ONE_LINE}
    outputs = {}
    for name, line in runs.items():  # one at a time: two launches of 2 ranks on CI's two cores
        script = _script(str(tmp_path / name), line)
        outputs[name] = _run(script, ckpt, data, str(tmp_path / f"out-{name}"), hang_at_exit_allowed=line is None)
    assert outputs["vanilla"][0] in (0, "hung at exit"), outputs["vanilla"][1][-6000:]
    assert outputs["rtp"][0] == 0, outputs["rtp"][1][-6000:]
    vanilla, rotated = _losses(str(tmp_path / "out-vanilla")), _losses(str(tmp_path / "out-rtp"))
    assert len(rotated) == STEPS and rotated[0] == pytest.approx(vanilla[0], abs=1e-5)
    # TRL keeps QLoRA adapters in bf16: a bf16 rounding of the ring's summation order can move a later step
    assert rotated == pytest.approx(vanilla, abs=2e-3), (rotated, vanilla)
    served = [_served(ckpt, str(tmp_path / f"out-{name}")) for name in ("vanilla", "rtp")]
    assert (served[0] - served[1]).abs().max() < 2e-2
