"""PEFT compatibility: size LoRA layers on rotated modules by their global features.

PEFT sizes adapters for a layer whose weight is a DTensor by the local shard, unless the mesh is
named "fsdp": under transformers' tensor parallelism a module computes only its shard of the
output. A rotated module, like an FSDP one, computes the full projection, so its adapters must be
full-size too. Until PEFT knows the `rtp` mesh, this wraps its size lookup for hf_rtp's modules
and leaves every other module to PEFT.
"""

from __future__ import annotations

import sys

from ..layers import RotatedConv1D, RotatedLinear


def make_peft_use_global_features() -> None:
    try:
        from peft.tuners import tuners_utils
    except ImportError:
        return
    original = tuners_utils._get_in_out_features
    if getattr(original, "hf_rtp", False):
        return

    def get_in_out_features(module):
        if isinstance(module, RotatedLinear):
            return module.in_features, module.out_features
        if isinstance(module, RotatedConv1D):
            return module.nx, module.nf
        return original(module)

    get_in_out_features.hf_rtp = True
    # PEFT's tuner modules import the function by name; rebind it wherever that happened already.
    for name, module in list(sys.modules.items()):
        if name.startswith("peft.") and getattr(module, "_get_in_out_features", None) is original:
            module._get_in_out_features = get_in_out_features
