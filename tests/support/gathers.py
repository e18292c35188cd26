"""hf_rtp's collectives outside the ring, checked against vanilla transformers in one rank of a world: full_tensor()
(without autograd, and under it), redistribute to Replicate, context_parallel_unshard of the logits,
save_pretrained's files and resize_token_embeddings' scatter. tests/gpu/test_gathers_cuda.py runs it on cuda:0;
tests/distributed/test_staged_gathers.py on the CPU, there with the rotation mesh's host twin forced, so that the
host-staged path a world of gloo on CUDA takes (distributed/transport/backends.py, `staged`) runs where CI can run
it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _GroupsGathered(TorchDispatchMode):
    """The names of the process groups DTensor's all_gathers ran on (functional collectives name their group)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in func.name():
            self.names.add(args[2])  # (input, group_size, group_name)
        return func(*args, **(kwargs or {}))


def gathers_beside_vanilla(ckpt, out, device, force_host: bool = False):
    """In a rank: ({check: held}, (logits gap, logits scale, logits device))."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.transport.backends import staged

    from .models import global_batch

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device, fused_loss=False)
    rank, world = dist.get_rank(), dist.get_world_size()  # the world hf_rtp joined, or started
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device)
    theirs = dict(vanilla.named_parameters())
    rotated = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    mesh = next(iter(rotated.values())).device_mesh
    if force_host:  # what a world of gloo on CUDA sets (RotationMesh.of), on the CPU: over a group of its own here,
        # so that which group each gather ran on shows which path it took
        host = dist.new_group(ranks=list(range(world)), backend="gloo")
        mesh.host = DeviceMesh.from_group(host, "cpu", mesh_dim_names=("rtp",))
    checks = {"staged": getattr(mesh, "host", None) is not None}
    if device.type == "cpu":  # a gloo world: gloo would serve CUDA tensors too, so those would be staged
        checks["decided"] = staged(mesh.get_group(), torch.device("cuda")) and not staged(mesh.get_group(), device)
    with torch.no_grad(), _GroupsGathered() as gathered:
        checks["full_tensor"] = all(torch.equal(p.full_tensor(), theirs[n]) for n, p in rotated.items())
        checks["redistribute"] = all(
            torch.equal(p.redistribute(placements=[Replicate()]).to_local(), theirs[n]) for n, p in rotated.items()
        )
    wanted = mesh.host.get_group() if force_host else mesh.get_group()
    checks["gathered_on"] = bool(gathered.names) and gathered.names == {wanted.group_name}
    weight = rotated["model.layers.0.self_attn.q_proj.weight"]
    (weight.full_tensor().sum() * (rank + 1)).backward()  # its gradient: the mean over ranks of rank + 1
    grad = weight.grad.to_local()
    checks["full_tensor_grad"] = bool(torch.all(grad == sum(range(1, world + 1)) / world))
    checks["grad_on_device"] = grad.device == weight.to_local().device
    weight.grad = None

    ids = global_batch(world).to(device)[0]  # one sequence, cut across the ring
    batch = {"input_ids": ids}
    with torch.no_grad(), hf_rtp.context_parallel(model, batch):
        (logits,) = hf_rtp.context_parallel_unshard(model, [model(**batch).logits], [1])
    with torch.no_grad():
        want = vanilla(input_ids=ids).logits
    logits_gap = ((logits - want).abs().max().item(), want.abs().max().item(), str(logits.device))

    target = out / "saved"
    model.save_pretrained(target)
    dist.barrier()
    saved = load_file(str(target / "model.safetensors"), device="cpu")
    state = {k: v.cpu() for k, v in vanilla.state_dict().items()}
    checks["saved"] = bool(saved) and all(k in state and torch.equal(v, state[k]) for k, v in saved.items())

    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(old + 8, mean_resizing=False)
    with torch.no_grad():
        resized = model.get_input_embeddings().weight.full_tensor()
    checks["resized"] = resized.shape[0] == old + 8 and torch.equal(resized[:old], theirs["model.embed_tokens.weight"])
    return checks, logits_gap
