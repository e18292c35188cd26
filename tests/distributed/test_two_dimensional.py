"""Rings inside replicas: on a 2-D ("dp", "rtp") grid a rotated model trains, saves and resumes like
vanilla DDP over all ranks.

4 ranks as 2 replicas of 2-rank rings, from rtp_size=2 or from a device mesh of the user's. Every rank
has its own batch; vanilla runs the global batch in the same process. Float64, as test_equivalence.
"""

import json
import os

import pytest
import torch
from support.compare import (
    DTYPE,
    STEP_ATOL,
    adamw,
    assert_matches,
    assert_same_model,
    float64_loss,
    save_and_check_reload,
    step_both,
)
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _load(ckpt, layout):
    """hf_rtp's model at `layout` ("rtp_size=K", or "mesh": rings {0, 2} and {1, 3}) and vanilla's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.model.state import state_of

    with open(os.path.join(ckpt, "config.json")) as f:  # grouped_mm experts have no float64 kernel
        extra = {"experts_implementation": "eager"} if json.load(f)["model_type"] == "mixtral" else {}
    if layout == "mesh":
        dist.init_process_group("gloo")
        # rings of non-contiguous ranks: the mesh's rows, not rank order, decide who rotates with whom
        mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "rtp"))
        model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, device_mesh=mesh, **extra)
    else:
        model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, rtp_size=int(layout.split("=")[1]), **extra)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE, **extra)
    return model, ref, state_of(model).topology


def _train_and_save(ckpt, layout, out_dir):
    import torch.distributed as dist

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, ref, topology = _load(ckpt, layout)
    assert (topology.dp_size, topology.rtp_size) == (2, 2)
    assert_same_model(model, ref, topology.rtp_size, topology.rtp_rank)
    model.train(), ref.train()
    loss = step_both(model, ref, adamw(model, ref), global_batch(world), rank)

    # full_tensor() under autograd: each chunk's gradient is the mean over all four ranks' batches,
    # not over its own ring's two: rank r weighs the head by r + 1, so the mean is 2.5 everywhere.
    head = model.lm_head.weight
    (head.full_tensor() * (rank + 1)).sum().backward()
    torch.testing.assert_close(head.grad.to_local(), torch.full_like(head.grad.to_local(), 2.5))
    model.zero_grad()

    # replicated gradients need the mean over the whole grid: a step without sync_grads or DDP is refused
    batch = global_batch(world)[rank]
    model(input_ids=batch, labels=batch).loss.backward()
    with pytest.raises(hf_rtp.UnsyncedGradientsError, match="never averaged over the 4 ranks"):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.zero_grad()

    # generate: each replica's ring steps through its own prompt, every rank together
    prompt = global_batch(world, seq=4)[rank][:1]
    model.eval(), ref.eval()
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **greedy), ref.generate(prompt, **greedy))

    save_and_check_reload(model, out_dir, rank)
    dist.barrier()
    return topology.dp_rank, topology.rtp_rank, topology.is_writer, loss


@pytest.mark.parametrize(
    "arch,layout",
    [("llama", "rtp_size=2"), ("gpt2", "rtp_size=2"), ("mixtral", "mesh")],
    ids=["llama", "gpt2", "mixtral-mesh"],
)
def test_two_replicas_of_two_rank_rings_train_save_like_vanilla_ddp(tmp_path, arch, layout):
    ckpt = make_tiny(arch, tmp_path / "ckpt")
    results = run_on_ranks(_train_and_save, 4, ckpt, layout, str(tmp_path / "out"))
    places = [r[:3] for r in results]
    if layout == "mesh":  # rows [0, 2] and [1, 3]
        assert places == [(0, 0, True), (1, 0, False), (0, 1, False), (1, 1, False)]
    else:  # contiguous rings: [0, 1] and [2, 3]
        assert places == [(0, 0, True), (0, 1, False), (1, 0, False), (1, 1, False)]
    assert len({r[3] for r in results}) == 4  # four batches, four losses
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]


def _save_at_2x2(ckpt, state_dir):
    from hf_rtp.training_state import save_training_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, ref, _ = _load(ckpt, "rtp_size=2")
    model.train(), ref.train()
    optimizers = adamw(model, ref)
    step_both(model, ref, optimizers, global_batch(world), rank)
    save_training_state(state_dir, model, optimizers[0], extra={"step": 1})
    return sum(p.numel() for p in ref.parameters())


def _resume_and_step(ckpt, state_dir, rtp_size):
    from hf_rtp.training_state import load_training_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, ref, topology = _load(ckpt, f"rtp_size={rtp_size}")
    model.train(), ref.train()
    optimizers = adamw(model, ref)
    assert load_training_state(state_dir, model, optimizers[0])["step"] == 1
    # vanilla takes the saved step itself, on the 2x2 run's four batches
    ref_optimizer = optimizers[1]
    torch.stack([float64_loss(ref(input_ids=b, labels=b), b, ref.config) for b in global_batch(4)]).mean().backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    assert_matches(model, ref, topology.rtp_size, topology.rtp_rank, "param", atol=STEP_ATOL)
    # the next step at this layout depends on AdamW's moments and step count: equal only if they resumed
    return step_both(model, ref, optimizers, global_batch(world, seed=2), rank)


def test_training_state_saved_at_2x2_resumes_at_1x4_4x1_and_on_two_ranks(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    state_dir = str(tmp_path / "checkpoint-1")
    numel = run_on_ranks(_save_at_2x2, 4, ckpt, state_dir)[0]
    # each chunk once, not once per replica: weights and AdamW's two moments, 8 bytes each, and headers
    stored = sum(
        os.path.getsize(os.path.join(state_dir, f)) for f in os.listdir(state_dir) if f.endswith(".safetensors")
    )
    assert 3 * 8 * numel <= stored < 1.25 * 3 * 8 * numel
    with open(os.path.join(state_dir, "training_state.json")) as f:
        assert json.load(f)["world_size"] == 4
    for world, rtp_size in ((4, 4), (4, 1), (2, 2)):
        losses = run_on_ranks(_resume_and_step, world, ckpt, state_dir, rtp_size)
        assert len(set(losses)) == world


def _load_asking(ckpt, sizes):
    import hf_rtp

    try:
        hf_rtp.from_pretrained(ckpt, rtp_size=sizes[int(os.environ["RANK"])])
    except hf_rtp.TopologyError as err:
        return str(err)
    return None


def test_rings_that_do_not_tile_the_ranks_or_differ_between_ranks_fail_on_every_rank(tmp_path):
    import hf_rtp

    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for message in run_on_ranks(_load_asking, 3, ckpt, [2, 2, 2]):
        assert "rtp_size=2 does not divide the 3 ranks" in message and "(1, 3)" in message
    # one rank asking for other rings would otherwise make other process groups and wait forever
    for message in run_on_ranks(_load_asking, 2, ckpt, [1, 2]):
        assert "ranks asked for different rings" in message
    first, second = run_on_ranks(_load_asking, 2, ckpt, [3, 2])  # only rank 0's is impossible
    assert first.startswith("rtp_size=3 does not divide the 2 ranks")
    assert second.startswith("rank 0 failed: rtp_size=3 does not divide the 2 ranks")
    with pytest.raises(hf_rtp.TopologyError, match="rtp_size=2 does not divide the 1 ranks"):
        hf_rtp.from_pretrained(ckpt, rtp_size=2)
    with pytest.raises(hf_rtp.TopologyError, match="positive number of ranks per ring"):
        hf_rtp.from_pretrained(ckpt, rtp_size=0)


def _count_bytes(ckpt):
    import hf_rtp

    # the cost model counts training at scale, where every op moves its weights; this step's 9 tokens per rank
    # would move the embedding's tokens instead, fewer bytes (rotation_moves="auto", test_generate_moves.py)
    model = hf_rtp.from_pretrained(ckpt, rtp_size=2, rotation_moves="weights").train()
    ring = hf_rtp.state_of(model).topology.ring
    ring.sent_bytes = ring.replica_sum.reduced_bytes = 0
    batch = global_batch(4)[int(os.environ["RANK"])]
    model(input_ids=batch, labels=batch).loss.backward()  # the fused loss: the head walks forward and back
    return ring.sent_bytes, ring.replica_sum.reduced_bytes


def test_bytes_on_the_ring_and_across_replicas_are_what_the_cost_model_counts(tmp_path):
    """hf_rtp/tools/cost.py (docs/multi-node.md's table) models a ring of K as sending, per step, every chunk K-1 hops
    forward and K-1 hops backward and the other ranks' gradient for it K-1 hops home, and each replica
    all-reducing its chunk of the gradient. The embedding is the exception: backward sends its
    gradient only."""
    from safetensors import safe_open

    ckpt = make_tiny("llama", tmp_path / "ckpt")
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    nbytes = {
        name: 4 * torch.Size(shape).numel() for name, shape in sizes.items() if len(shape) == 2
    }  # norms stay whole
    k = 2
    walks = {name: 1 if "embed_tokens" in name else 2 for name in nbytes}
    expected_ring = sum(b * (k - 1) * (walks[name] + 1) for name, b in nbytes.items())
    counted = run_on_ranks(_count_bytes, 4, ckpt)
    for ring in ([0, 1], [2, 3]):
        assert sum(counted[r][0] for r in ring) == expected_ring
        assert sum(counted[r][1] for r in ring) == sum(nbytes.values())  # each chunk once, per replica


def _accumulate_two_micro_batches(ckpt):
    from support.compare import backward_both, rows

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, ref, topology = _load(ckpt, "rtp_size=2")
    model.train(), ref.train()
    replicas = topology.ring.replica_sum
    seen = []

    # when autograd reaches the embedding (the last layer backward visits), every later layer's sum
    # over the replicas has started and none has been waited for: they overlap the backward
    def count_at_embedding(module, args, out):
        out.register_hook(lambda grad: seen.append(replicas.in_flight))

    model.model.embed_tokens.register_forward_hook(count_at_embedding)
    for micro in range(2):  # gradient accumulation: the second backward adds to summed .grad
        backward_both(model, ref, global_batch(world, seed=micro), rank)
        assert replicas.in_flight == 0  # all waited for before backward() returned
    assert seen[0] > 0 and seen[0] == seen[1], seen
    assert_matches(model, ref, topology.rtp_size, topology.rtp_rank, "grad")

    # torch.autograd.grad accumulates nothing, so the sum runs inside the layer's backward instead
    batch = global_batch(world, seed=2)[rank]
    head = model.lm_head.weight
    (mine,) = torch.autograd.grad(model(input_ids=batch).logits.sum() * (rank + 1), [head])
    ref_head = ref.lm_head.weight
    (theirs,) = torch.autograd.grad(
        sum(ref(input_ids=b).logits.sum() * (r + 1) for r, b in enumerate(global_batch(world, seed=2))) / world,
        [ref_head],
    )
    torch.testing.assert_close(mine.to_local(), theirs[rows(head, topology.rtp_size, topology.rtp_rank)])

    # reentrant checkpointing runs each layer's backward in a backward of its own: the sums still complete
    model.zero_grad(), ref.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    backward_both(model, ref, global_batch(world, seed=3), rank)
    assert replicas.in_flight == 0
    assert_matches(model, ref, topology.rtp_size, topology.rtp_rank, "grad")
    return seen[0]


def test_replica_sums_overlap_earlier_layers_and_are_complete_when_backward_returns(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    in_flight = run_on_ranks(_accumulate_two_micro_batches, 4, ckpt)
    # the head and both decoder layers' projections (7 each) had started, all but the embedding
    assert all(n >= 15 for n in in_flight), in_flight
