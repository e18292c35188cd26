"""QLoRA on CUDA: a 4-bit base through bitsandbytes' CUDA kernels, at two ranks on cuda:0, beside vanilla
transformers + bitsandbytes + PEFT under DDP on the same GPU (NF4, double quantization, bf16 compute, float32
weights elsewhere, as PEFT's recipe leaves them).

What equality holds:
- the quantized weight is vanilla's exactly: each rank's packed rows and the scales its matmul uses equal
  vanilla's rows byte for byte, so its dequantized rows equal vanilla's (`torch.equal`);
- the outputs are vanilla's up to bf16 rounding: bitsandbytes' `gemm_4bit` picks its kernel by shape (a matrix
  of a chunk's rows is another shape than the whole weight), and each rounds its bf16 products in its own order.
  The logits, the loss and every LoRA gradient are held to 3e-2 of their largest entry; a wrong chunk, a lost
  piece or a scale off by a block is off by the whole entry.
Skipped, saying why, where bitsandbytes is not installed (the device image has none: docs/testing.md says how to
carry its wheel) or has no CUDA kernels here.
"""

from __future__ import annotations

import importlib.util

import op_trace
import pytest
import torch
from gpu_world import NO_CUDA, join_world
from support.compare import lora_step_both, vanilla_training_path
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # widths in whole 64-value blocks, as real models'
TARGETS = ["q_proj", "v_proj", "down_proj"]
BF16 = 3e-2  # of the largest entry


def why_not_bitsandbytes_on_cuda() -> str | None:
    """None when bitsandbytes and PEFT import and bitsandbytes quantizes and dequantizes on CUDA; else why not."""
    for package in ("bitsandbytes", "peft"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (carry its wheel to the GPU machine: docs/testing.md)"
    try:
        import bitsandbytes.functional as bnb_functional

        weight = torch.randn(64, 64, device="cuda")
        packed, state = bnb_functional.quantize_4bit(weight, quant_type="nf4")
        if not bnb_functional.dequantize_4bit(packed, state).is_cuda:
            return "bitsandbytes dequantized a CUDA weight off the GPU"
    except Exception as err:  # an import or a kernel that fails here is the reason to skip, named
        return f"bitsandbytes has no working CUDA kernels here: {type(err).__name__}: {err}"
    return None


def _quantization():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _same_weights(model, vanilla, rank: int, world: int) -> dict[str, tuple[bool, bool]]:
    """Per 4-bit linear: (this rank's packed rows and scales are vanilla's, its dequantized rows are vanilla's)."""
    import bitsandbytes.functional as bnb_functional

    from hf_rtp.distributed.tensors.sharding import chunk_rows

    same = {}
    for name, module in vanilla.named_modules():
        if type(module).__name__ != "Linear4bit":
            continue
        ours = model.get_submodule(name)
        weight, state = module.weight, module.weight.quant_state
        out, inp = state.shape
        start, end = chunk_rows(out, world, rank)
        absmax = state.absmax
        if state.nested:  # double quantization: the float32 scales vanilla's matmul dequantizes to
            absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        packed, scales = ours.unpack(ours.weight.to_local())
        bytes_equal = torch.equal(
            packed.view(-1, inp // 2), weight.data.view(out, inp // 2)[start:end]
        ) and torch.equal(scales.view(end - start, -1), absmax.view(out, -1)[start:end])
        whole = bnb_functional.dequantize_4bit(weight.data, state)
        same[name] = (bytes_equal, torch.equal(ours.dequantized_rows(), whole[start:end]))
    return same


def _qlora_beside_vanilla(ckpt):
    device = join_world()
    with op_trace.from_env():  # bitsandbytes' calls and their arguments, where .ci/gpu asks (a crash's diagnosis)
        return _steps(ckpt, device)


def _steps(ckpt, device):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device, quantization_config=_quantization())
    vanilla = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, quantization_config=_quantization(), device_map={"": device}
    )
    vanilla = vanilla_training_path(vanilla)  # a no-op on CUDA; on a CPU with AVX512-BF16, the path CUDA takes
    same = _same_weights(model, vanilla, rank, world)

    batch = global_batch(world, seq=12)[rank].to(device)
    with torch.no_grad():
        ours, theirs = (m(input_ids=batch).logits for m in (model, vanilla))
    logits = ((ours - theirs).abs().max().item(), theirs.abs().max().item())
    _, losses, gaps = lora_step_both(model, vanilla, batch, TARGETS)
    return same, logits, losses, gaps


def test_a_4bit_base_on_cuda_keeps_vanillas_weights_and_its_outputs_to_bf16_rounding(tmp_path):
    reason = why_not_bitsandbytes_on_cuda()
    if reason:
        pytest.skip(reason)
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (same, logits, losses, grads) in enumerate(run_on_ranks(_qlora_beside_vanilla, 2, ckpt, fresh=True)):
        assert len(same) == 14, (rank, same)  # 7 linears per layer, 2 layers
        assert all(bytes_equal and rows_equal for bytes_equal, rows_equal in same.values()), (rank, same)
        gap, scale = logits
        assert gap <= BF16 * scale, (rank, gap, scale)
        assert abs(losses[0] - losses[1]) <= BF16 * abs(losses[1]), (rank, losses)
        assert sum("lora_A" in n for n in grads) == sum("lora_B" in n for n in grads) == 6, (rank, sorted(grads))
        for name, (difference, largest) in grads.items():
            assert largest > 0 and difference <= BF16 * largest, (rank, name, difference, largest)
