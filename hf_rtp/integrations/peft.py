"""PEFT compatibility: size LoRA layers on rotated modules by their global features.

Stands in for `peft.tuners.tuners_utils._get_in_out_features` (PEFT 0.15 to 0.21, the versions tested).
PEFT sizes adapters for a layer whose weight is a DTensor by the local shard, unless the mesh is named
"fsdp": under transformers' tensor parallelism a module computes only its shard of the output. A
rotated module, like an FSDP one, computes the full projection, so its adapters must be full-size too.
Until PEFT knows the `rtp` mesh, the name `_get_in_out_features` in PEFT's modules points at a function
that answers for hf_rtp's modules and hands every other module to PEFT's own, unchanged.

Outside the tested versions nothing is replaced, and a warning says so: PEFT's own rule then sizes
adapters on rotated layers, and a wrong size fails at the first forward (a shape mismatch), never silently.
"""

from __future__ import annotations

import sys

from packaging.version import Version

from .. import log
from ..layers import RotatedConv1D, RotatedLinear

TESTED = ((0, 15), (0, 22))  # from, up to (excluded): PEFT versions whose _get_in_out_features this stands in for
_MARK = "hf_rtp_stands_in_for"


def make_peft_use_global_features() -> None:
    try:
        import peft
        from peft.tuners import tuners_utils
    except ImportError:
        return
    original = getattr(tuners_utils, "_get_in_out_features", None)
    if getattr(original, _MARK, None) is not None:
        return
    if original is None or not TESTED[0] <= Version(peft.__version__).release[:2] < TESTED[1]:
        log.warning(
            f"PEFT {peft.__version__} is outside the versions hf_rtp adapts (>={'.'.join(map(str, TESTED[0]))}, "
            f"<{'.'.join(map(str, TESTED[1]))}): LoRA adapters on rotated layers are sized by PEFT's own rule "
            "(peft.tuners.tuners_utils._get_in_out_features), which fails at the first forward if it is wrong"
        )
        return

    def get_in_out_features(module):
        if isinstance(module, RotatedLinear):
            return module.in_features, module.out_features
        if isinstance(module, RotatedConv1D):
            return module.nx, module.nf
        return original(module)

    setattr(get_in_out_features, _MARK, "peft.tuners.tuners_utils._get_in_out_features")
    # PEFT's tuner modules import the function by name; rebind it wherever that happened already.
    for name, module in list(sys.modules.items()):
        if name.startswith("peft.") and getattr(module, "_get_in_out_features", None) is original:
            module._get_in_out_features = get_in_out_features

