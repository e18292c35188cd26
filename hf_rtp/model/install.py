"""Put loaded tensors into an empty (meta) model: rotated modules get Shard(0) DTensors, the rest plain ones."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..distributed.ranks.topology import Topology
from ..distributed.tensors.rotated import make_rotated
from ..errors import UnsupportedModelError
from ..layers import LAYERS, RotatedLinear, siblings
from ..plans import Resolution
from .ties import tie_targets


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds, by name: those a checkpoint stores and a load must read (a router's
    `e_score_correction_bias`), not the ones computed at construction (rotary tables, registered non-persistent)."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                found[f"{prefix}.{key}" if prefix else key] = buffer
    return found


def rotated_parameter(local: torch.Tensor, shape: torch.Size, topology: Topology) -> nn.Parameter:
    stride = torch.empty(shape, device="meta").stride()
    dtensor = DTensor.from_local(local, topology.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    # a quantized layer's packed rows are bytes, which never train (integrations/bitsandbytes.py)
    return make_rotated(nn.Parameter(dtensor, requires_grad=local.is_floating_point()))


def install(model: nn.Module, resolution: Resolution, tensors: dict[str, torch.Tensor], topology: Topology) -> None:
    """Replace every parameter of `model` by the loaded one, and rotated modules by their rotated op."""
    rotate = topology.rtp_size > 1  # rings of one (rtp_size=1): plain data parallel
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = persistent_buffers(model)
    params: dict[str, nn.Parameter] = {}
    for name, tensor in tensors.items():
        if name in buffers:  # read whole, as vanilla loads it; never rotated
            owner, _, leaf = name.rpartition(".")
            (model.get_submodule(owner) if owner else model)._buffers[leaf] = tensor
        elif rotate and name in resolution.rotated_params:
            params[name] = rotated_parameter(tensor, shapes[name], topology)
        else:
            params[name] = nn.Parameter(tensor)
    for target, source in tie_targets(model).items():
        params[target] = params[source]

    for name, param in params.items():
        owner, _, leaf = name.rpartition(".")
        if not (rotate and owner in resolution.rotated):
            setattr(model.get_submodule(owner) if owner else model, leaf, param)
    if rotate:
        for module_name, kind in resolution.rotated.items():
            original: Any = model.get_submodule(module_name)  # of the class the plan resolved for `kind`
            if persistent_buffers(original):  # its rotated op would drop them: refused, never lost silently
                raise UnsupportedModelError(
                    f"{module_name} ({type(original).__name__}) holds stored buffers "
                    f"({', '.join(persistent_buffers(original))}) that its rotated {kind} layer does not keep: "
                    "leave it out of the plan (hf_rtp.Plan), or load it with vanilla transformers"
                )
            leaves = {leaf: params[f"{module_name}.{leaf}"] for leaf, _ in original.named_parameters(recurse=False)}
            rotated = LAYERS[kind].rotated(original, ring=topology.ring, **leaves)
            model.set_submodule(module_name, rotated)
            first = params[f"{module_name}.{LAYERS[kind].rotated_leaves[0]}"]
            topology.ring.plan(rotated.layout, cast(DTensor, first).to_local())

    if rotate:
        parents = {name.rpartition(".")[0] for name, kind in resolution.rotated.items() if kind == "linear"}
        for parent in parents:
            siblings.group(model.get_submodule(parent), (RotatedLinear,))
    outputs = getattr(model, "get_output_embeddings", None)
    head = outputs() if callable(outputs) else None
    if isinstance(head, RotatedLinear):
        head.is_head = True
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(topology.device)
