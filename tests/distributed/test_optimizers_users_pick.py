"""Optimizers and loss scalers users pick beside a rotated model: equal to vanilla DDP in the same
processes, or refused by name (ZeroRedundancyOptimizer: the rows are already sharded; Adafactor: its
factored second moment needs whole columns)."""

import os

import pytest
import torch
from support.compare import assert_matches
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

from hf_rtp.private.torch_names import SUBCLASS_DISPATCH_BYPASSED


def _scaled_steps(ckpt, replicated_first):
    """Two fp16-autocast SGD steps with torch.amp.GradScaler, hf_rtp beside vanilla under DDP."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    vanilla = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train())
    initial = {n: p.detach().clone() for n, p in vanilla.module.named_parameters()}
    batch = global_batch(world)[rank]
    scales = []
    for m in (model, vanilla):
        named = list(m.named_parameters())
        if replicated_first:  # a norm (or a VLM's vision tower) before the first rotated parameter
            named.sort(key=lambda item: isinstance(item[1], DTensor))
        assert isinstance(named[0][1], DTensor) != replicated_first or m is vanilla
        optimizer = torch.optim.SGD([p for _, p in named], lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(input_ids=batch, labels=batch).loss
            scaler.scale(loss).backward()
            if m is model:
                hf_rtp.sync_grads(model)
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1], scales
    # fp16 matmuls whose reductions the ring splits round apart (~fp16's 1e-3 of a gradient): compare the
    # updates within 1% of the largest one; an unscaled or doubly scaled step is off by a factor of 256
    largest = max((p.detach() - initial[n]).abs().max().item() for n, p in vanilla.module.named_parameters())
    assert largest > 1e-3
    assert_matches(model, vanilla.module, world, rank, "param", atol=0.01 * largest, rtol=0)
    return True


@pytest.mark.parametrize("replicated_first", [False, True], ids=["rotated-first", "replicated-first"])
def test_grad_scaler_equals_ddp_whatever_the_parameter_order(tmp_path, replicated_first):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    assert run_on_ranks(_scaled_steps, 2, ckpt, replicated_first) == [True, True]


def _zero(ckpt):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    batch = global_batch(2)[int(os.environ["RANK"])]
    try:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        model(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)  # as a plain loop must: the refusal is ZeRO's, not the unaveraged norms'
        optimizer.step()  # each rank steps its share of the parameters, then broadcasts it
    except hf_rtp.RotatedStateError as err:
        return str(err)
    except NotImplementedError as err:  # torch 2.11 skips RotatedTensor's dispatch: DTensor's own refusal
        return str(err)
    return None


def test_zero_redundancy_optimizer_is_refused_by_name(tmp_path):
    for message in run_on_ranks(_zero, 2, make_tiny_llama(tmp_path / "ckpt")):
        if SUBCLASS_DISPATCH_BYPASSED:  # no rank broadcasts its rows over the others' all the same
            assert message is not None and "c10d.broadcast_" in message and "sharding strategy" in message
            continue
        assert message is not None and "on a rotated tensor" in message
        assert "ZeroRedundancyOptimizer has nothing left to shard" in message and "torch.optim.AdamW" in message


def _adafactor(ckpt, out):
    from transformers import Adafactor, Trainer, TrainingArguments

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    batch = global_batch(2)[int(os.environ["RANK"])]
    optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    model(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)  # as a plain loop must: the refusal is Adafactor's, not the unaveraged norms'
    with pytest.raises(hf_rtp.RotatedStateError) as stepped:
        optimizer.step()
    args = TrainingArguments(output_dir=out, optim="adafactor", use_cpu=True, report_to=[])
    with pytest.raises(hf_rtp.RotatedStateError) as built:  # Trainer's optim="adafactor": at construction
        Trainer(model=model, args=args)
    return str(stepped.value), str(built.value)


def test_adafactor_is_refused_by_name_not_a_bare_assertion(tmp_path):
    for stepped, built in run_on_ranks(_adafactor, 2, make_tiny_llama(tmp_path / "ckpt"), str(tmp_path / "out")):
        assert "Adafactor" in stepped and "torch.optim.AdamW" in stepped, stepped
        assert "optim='adafactor'" in built and "adamw_torch" in built, built
