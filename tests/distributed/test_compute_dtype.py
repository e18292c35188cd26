"""Under bf16 autocast over float32 weights the ring carries bf16 weights: half the bytes, the same numbers.

Autocast casts each float32 weight to bf16 at its matmul, so casting a rank's own piece once before
it travels gives every matmul the same inputs. The reference for "the same" is hf_rtp's earlier
float32 rotation (Ring.travel_dtype pinned to the parameter's dtype), run in the same processes:
losses, logits and every gradient must be bit-equal to it, at 2 and 3 ranks, for a linear (Llama),
a Conv1D cut by input features (GPT-2) and fused experts (Mixtral), fused loss included. Where no
matmul is split along its reduction (Llama's forward) the logits are also bit-equal to vanilla's
under the same autocast; GPT-2's Conv1D sums partial products per chunk, which rounds differently
from one matmul (tests/distributed/test_dtypes.py bounds that against vanilla).
"""

import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

from hf_rtp.distributed.transport.pool import HEADROOM


def _run(ckpt, batch, **load):
    """(loss, logits, every gradient as this rank holds it, weight bytes the ring sent, weight slot bytes)."""
    from torch.distributed.tensor import DTensor

    import hf_rtp
    from hf_rtp.model.state import state_of

    # what the weights' walks carry and hold: this batch's few tokens would move instead in some ops (the
    # embedding's), which test_generate_moves.py compares with vanilla
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, rotation_moves="weights", **load).train()
    ring = state_of(model).topology.ring
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sent = ring.sent_bytes
        model(input_ids=batch)  # a forward sends weights only
        forward_bytes = ring.sent_bytes - sent
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch).logits
        loss = model(input_ids=batch, labels=batch).loss
    (loss + logits.float().square().mean()).backward()
    hf_rtp.sync_grads(model)
    grads = {n: (p.grad.to_local() if isinstance(p, DTensor) else p.grad) for n, p in model.named_parameters()}
    slots = sum(b.nbytes for b in ring.pool.buffers("weights"))
    return loss.detach(), logits.detach(), grads, forward_bytes, slots, ring


def _bf16_rotation_is_exact(checkpoints, plain):
    from transformers import AutoModelForCausalLM

    from hf_rtp.distributed.transport.ring import Ring

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    ratios = {}
    for arch, ckpt in checkpoints.items():
        loss, logits, grads, forward_bytes, slots, _ = _run(ckpt, batch)
        travel = Ring.travel_dtype
        Ring.travel_dtype = lambda self, own, dtype: own[0].dtype  # the float32 rotation this replaced
        try:
            old_loss, old_logits, old_grads, old_forward_bytes, old_slots, _ = _run(ckpt, batch)
        finally:
            Ring.travel_dtype = travel
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, old_logits), arch
        assert torch.equal(loss, old_loss), arch
        for name, grad in grads.items():
            assert grad.dtype == torch.float32, (arch, name)  # .grad keeps the master weight's dtype
            assert torch.equal(grad, old_grads[name]), (arch, name)
        if arch == "llama":
            ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(logits, ref(input_ids=batch).logits)
            # every matmul's weights travel in bf16; the embedding's lookup stays float32 (vanilla's is)
            # half the bytes (each slot also holds at most HEADROOM more: a watched hop's header after its piece)
            assert abs(slots * 2 - old_slots) <= 4 * HEADROOM, (slots, old_slots)
        ratios[arch] = forward_bytes / old_forward_bytes
    if world == 2:  # in the same processes: one layer's bytes exactly, and reduce_dtype
        ratios["layer"] = _layer_traffic(plain)
        ratios["bf16 sums differ"] = _reduce_dtype(plain)
    return ratios


@pytest.mark.parametrize("world", [2, 3])
def test_autocast_rotation_sends_bf16_with_the_same_numbers(tmp_path, world):
    # a wide MLP, so its pieces (not the float32 embedding's) size the weight slots
    checkpoints = {
        arch: make_tiny(arch, tmp_path / arch, **({"intermediate_size": 256} if arch == "llama" else {}))
        for arch in ("llama", "gpt2", "mixtral")
    }
    plain = make_tiny("llama", tmp_path / "plain")
    for ratios in run_on_ranks(_bf16_rotation_is_exact, world, checkpoints, plain):
        # the forward's weights: half for every matmul; the float32 embedding rows keep their size
        assert 0.5 < ratios["llama"] < 0.6 and 0.5 < ratios["mixtral"] < 0.6, ratios
        assert ratios["gpt2"] < 0.7, ratios  # GPT-2's tied embedding is a larger share of a tiny model
        if world == 2:
            fp32_forward, fp32_backward, bf16_forward, bf16_backward = ratios["layer"]
            assert bf16_forward * 2 == fp32_forward > 0
            # backward: the weights walk again (halved), the float32 gradient accumulator travels (unchanged)
            assert fp32_backward - bf16_backward == fp32_forward // 2
            assert ratios["bf16 sums differ"]


def _layer_traffic(ckpt):
    from torch.distributed.tensor import DTensor

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    layer = model.model.layers[0].mlp.down_proj
    ring = layer.ring
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)

    def sent(autocast):
        layer.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            before = ring.sent_bytes
            out = layer(x)
            forward = ring.sent_bytes - before
            out.float().sum().backward()
        return forward, ring.sent_bytes - before - forward, layer.weight.grad

    fp32_forward, fp32_backward, _ = sent(False)
    bf16_forward, bf16_backward, grad = sent(True)
    assert isinstance(grad, DTensor) and grad.dtype == torch.float32
    return fp32_forward, fp32_backward, bf16_forward, bf16_backward


def _reduce_dtype(ckpt):
    from torch.distributed.tensor import DTensor

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    grads = []
    for reduce_dtype in (None, torch.bfloat16):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, reduce_dtype=reduce_dtype).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=batch, labels=batch).loss.backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
        grads.append({n: p.grad.to_local() for n, p in model.named_parameters() if isinstance(p, DTensor)})
    for name, exact in grads[0].items():
        # bf16 sums: close, not equal; an entry where the ranks' shares cancel is off by a bf16 rounding of a share,
        # up to 2^-8 of the largest entry (one of 1600 entries was 1.9e-4 off, its share's rounding, once the input
        # gradients were summed in float32 as vanilla's)
        limit = max(1e-4, 2**-8 * exact.abs().max().item())
        torch.testing.assert_close(grads[1][name], exact, atol=limit, rtol=2e-2)
    return any(not torch.equal(grads[1][n], g) for n, g in grads[0].items())
