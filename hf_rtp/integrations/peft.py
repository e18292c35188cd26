"""PEFT compatibility: size LoRA layers on rotated modules by their global features, give DoRA the
whole weight norm, and gather what PEFT saves of rotated trainable copies (`modules_to_save` of an
embedding or LM head, which stay rotated: a whole copy of a 128k-vocabulary head, its gradient and Adam
moments would be 8 GB per rank).

Stands in for `peft.tuners.tuners_utils._get_in_out_features` (PEFT 0.15 to 0.21, the versions tested).
PEFT sizes adapters for a layer whose weight is a DTensor by the local shard, unless the mesh is named
"fsdp": under transformers' tensor parallelism a module computes only its shard of the output. A
rotated module, like an FSDP one, computes the full projection, so its adapters must be full-size too.
Until PEFT knows the `rtp` mesh, the name `_get_in_out_features` in PEFT's modules points at a function
that answers for hf_rtp's modules and hands every other module to PEFT's own, unchanged.

Likewise `peft.tuners.lora.dora.DoraLinearLayer.get_weight_norm`: PEFT computes DoRA's per-row norm of
`W + scale * B @ A` with the base weight as it finds it, which on a rotated layer is a Shard(0) DTensor,
and the sharded norm then breaks the forward. The stand-in takes PEFT's own norm (each rank's rows, the
same arithmetic row by row) and gathers the [out_features] vector whole; PEFT detaches it anyway.
And `dequantize_module_weight` as `peft.tuners.lora.dora` calls it (QDoRA: DoRA over a 4-bit or 8-bit base),
which knows bitsandbytes' parameters, not hf_rtp's packed rows: each rank's rows dequantized as bitsandbytes
dequantizes vanilla's weight, as a rotated tensor. And `DoraLinearLayer.forward` on a rotated base layer: with
`lora_dropout > 0` PEFT recomputes the base output as `F.linear(x, base_layer.weight)` on the dropped-out
input, which on the rotated weight leaked a DTensor into the hidden states; the stand-in runs the rotated
layer itself there (on a quantized base, F.linear of the dequantized pieces over the ring), and takes a bias
back out gathered whole (PEFT subtracted the rotated bias, the same leak on biased layers).

And `trainable_token_indices` (PEFT's TrainableTokensLayer) on a rotated embedding or tied head: PEFT
reads the chosen rows with `weight[indices]` and merges them into a whole copy of the weight at every
forward (`index_copy`, then `F.embedding` / `F.linear`). The stand-ins for its `update_layer` and
`forward_adapters` read the rows once, exactly, over the ring (`rows_of`), and at each forward run the
rotated layer and then write the trainable rows' lookups (or logits) over its output: the same values,
with no whole copy.

And `peft.PeftModel.save_pretrained`, where what PEFT writes holds rotated tensors (a `modules_to_save` copy of a
rotated head or embedding): PEFT read their storage to write them, refused on a rank that holds only its rows; the
stand-in makes that save collective (`_stand_in_for_save_pretrained`).

Merging DoRA or trainable tokens into a rotated layer (`merge_and_unload`) is refused: PEFT merges with
whole-matrix arithmetic on the rotated weight, which gave wrong weights without an error. So is merging any
other tuner but LoHa and LoKr (IA3's, OFT's and BOFT's merges were wrong; the rest never compared). Plain LoRA,
LoHa, LoKr and `modules_to_save` merge correctly and are left alone. LoRA initialisations that compute from the
whole base weight and rewrite it (PiSSA, CorDA, OLoRA, MiCA, LoftQ, LoRA-GA) are refused on a rotated layer.
EVA's initialisation without its gather across ranks checks that every rank has the same batches
(`_stand_in_for_eva`).

The stand-ins go in when a rotated model is loaded, if PEFT is imported by then; otherwise when PEFT is
imported later, by a finder on `sys.meta_path` that runs PEFT's own import, then installs them and leaves
(`install_when_peft_is_imported`); a lookup that imports nothing (`importlib.util.find_spec`, which
transformers' `is_peft_available()` calls) leaves it in place. hf_rtp itself never imports PEFT: PEFT
imports bitsandbytes when it is installed, about 2 s per process that never uses either.

Outside the tested versions nothing is replaced, and a warning says so: PEFT's own rule then sizes
adapters on rotated layers, and a wrong size fails at the first forward (a shape mismatch), never silently.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
import threading
import zlib
from collections.abc import Mapping
from typing import cast

import numpy
import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn
from torch.distributed.tensor import DTensor

from .. import log
from ..distributed.ranks.agreement import agreed
from ..distributed.tensors.rotated import RotatedTensor, rotated_rows, rows_of, whole
from ..errors import CheckpointError, CollectiveMisuseError, RotatedStateError
from ..layers import RotatedConv1D, RotatedEmbedding, RotatedLinear
from ..layers.common import local
from ..layers.linear4bit import FrozenQuantizedLinear

TESTED = ((0, 15), (0, 22))  # from, up to (excluded): PEFT versions whose _get_in_out_features this stands in for
_MARK = "hf_rtp_stands_in_for"


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at each lookup of `peft` it lets the other finders find PEFT and has that spec's
    loader install the stand-ins once PEFT's own module code has run. It leaves sys.meta_path only then, when
    PEFT is really imported: `importlib.util.find_spec("peft")` (transformers' `is_peft_available()`) looks PEFT up
    without importing it, and must not use the finder up."""

    def __init__(self):
        self._looking = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != "peft" or getattr(self._looking, "now", False):
            return None
        self._looking.now = True  # the lookup below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking.now = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):  # this spec's loader only: a fresh object per find
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            run(module)
            make_peft_use_global_features()

        loader.exec_module = exec_module
        return spec


def install_when_peft_is_imported() -> None:
    """The stand-ins now if PEFT is imported, else at its import (when it is installed at all)."""
    if "peft" in sys.modules:
        make_peft_use_global_features()
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path) and importlib.util.find_spec("peft"):
        sys.meta_path.insert(0, _WhenImported())


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
        if isinstance(module, (RotatedLinear, RotatedConv1D)):
            # every tuner layer asks this of its base at creation, before its init runs: a tuner class defined
            # since PEFT's import (a user's custom LoRA layer overriding pissa_init or merge) gets its refusals now
            _refuse_inits_that_read_the_base()
            _refuse_merges_not_compared()
        if isinstance(module, RotatedLinear):
            return module.in_features, module.out_features
        if isinstance(module, RotatedConv1D):
            return module.nx, module.nf
        return original(module)

    setattr(get_in_out_features, _MARK, "peft.tuners.tuners_utils._get_in_out_features")
    # PEFT's tuner modules import the function by name; rebind it wherever that happened already.
    for name, module in list(sys.modules.items()):
        if name.startswith("peft.") and getattr(module, "_get_in_out_features", None) is original:
            setattr(module, "_get_in_out_features", get_in_out_features)  # noqa: B010 (a module's global)
    _stand_in_for_dora_norm()
    _stand_in_for_dora_dequantize()
    _stand_in_for_dora_forward()
    _stand_in_for_trainable_tokens()
    _stand_in_for_save_pretrained()
    _refuse_inits_that_read_the_base()
    _refuse_merges_not_compared()
    _stand_in_for_eva()


def _stand_in_for_dora_norm() -> None:
    from peft.tuners.lora.dora import DoraLinearLayer

    original = DoraLinearLayer.get_weight_norm
    if getattr(original, _MARK, None) is not None:
        return

    @functools.wraps(original)
    def get_weight_norm(self, weight, lora_weight, scaling, *args, **kwargs):
        norm = original(self, weight, lora_weight, scaling, *args, **kwargs)
        return whole(norm) if isinstance(norm, RotatedTensor) else norm

    setattr(get_weight_norm, _MARK, "peft.tuners.lora.dora.DoraLinearLayer.get_weight_norm")
    DoraLinearLayer.get_weight_norm = get_weight_norm  # the stand-in, see above


def _stand_in_for_dora_dequantize() -> None:
    """QDoRA (`use_dora=True` over a 4-bit or 8-bit base): PEFT reads the base weight for DoRA's norm and its
    dropout path through `dequantize_module_weight`, which knows bitsandbytes' parameter classes, not hf_rtp's
    packed rows (it would take the norm of the packed bytes). For a rotated quantized layer the stand-in gives this
    rank's rows dequantized as bitsandbytes dequantizes vanilla's weight, as a rotated tensor; DoRA's norm is then
    gathered whole (`_stand_in_for_dora_norm`). Rebinds the name in `peft.tuners.lora.dora` only, where DoRA calls
    it; every other module goes to PEFT's own."""
    from peft.tuners.lora import dora

    original = dora.dequantize_module_weight
    if getattr(original, _MARK, None) is not None:
        return

    @functools.wraps(original)
    def dequantize_module_weight(module):
        if isinstance(module, FrozenQuantizedLinear):
            return rotated_rows(cast(DTensor, module.weight), module.dequantized_rows())
        return original(module)

    setattr(dequantize_module_weight, _MARK, "peft.tuners.lora.dora.dequantize_module_weight")
    dora.dequantize_module_weight = dequantize_module_weight  # the stand-in, see above


def _stand_in_for_dora_forward() -> None:
    from peft.tuners.lora.dora import DoraLinearLayer

    original = DoraLinearLayer.forward
    if getattr(original, _MARK, None) is not None:
        return

    @functools.wraps(original)
    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
        if not isinstance(base_layer, (RotatedLinear, RotatedConv1D)):
            return original(
                self,
                x,
                lora_A=lora_A,
                lora_B=lora_B,
                scaling=scaling,
                base_layer=base_layer,
                base_result=base_result,
                adapter_name=adapter_name,
            )
        from peft.tuners.lora import dora

        # PEFT 0.21's arithmetic, line for line, with two rotated-safe steps
        lora_weight = self.get_lora_weight(lora_A=lora_A, lora_B=lora_B, adapter_name=adapter_name).to(x.dtype)
        weight = dora.dequantize_module_weight(base_layer).to(x.dtype)  # a quantized base's rows: the stand-in
        weight_norm = self.get_weight_norm(
            weight=weight, lora_weight=lora_weight.detach(), scaling=scaling, adapter_name=adapter_name
        ).detach()  # DoRA's norm is a constant (section 4.3 of the paper), as in PEFT
        mag_norm_scale = (self.weight / weight_norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        bias: torch.Tensor | None = base_layer.bias
        if base_result is None and isinstance(base_layer, FrozenQuantizedLinear):
            # lora_dropout > 0: PEFT runs F.linear on the dropped-out input and the dequantized weight, no bias
            base_result, bias = base_layer.dequantized_linear(x), None
        elif base_result is None:  # the same on a float weight: the rotated layer, whose bias comes off below
            base_result = base_layer(x)
        if bias is not None:  # DoRA scales the map without its bias; a rotated bias gathered whole
            base_result = base_result - (whole(bias) if isinstance(bias, DTensor) else bias).to(base_result.dtype)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling

    setattr(forward, _MARK, "peft.tuners.lora.dora.DoraLinearLayer.forward")
    DoraLinearLayer.forward = forward  # the stand-in, see the module's docstring


def adapter_state_dict(model) -> dict | None:
    """Collective. The state dict PEFT's `save_pretrained` takes (`state_dict=`), with the rotated tensors it
    would write (the trainable copies `modules_to_save` makes of a rotated embedding or head, or any other
    rotated tensor PEFT selects) gathered whole, in one order on every rank; None when it would write
    no rotated tensor, so PEFT's own save is right as it is. Pass it to `model.save_pretrained(dir,
    state_dict=...)` on the main process; or call `model.save_pretrained(dir)` on every rank, which gathers them
    itself (`_stand_in_for_save_pretrained`)."""
    state = model.state_dict()
    rotated = _rotated_written(model, state, list(model.peft_config), "auto")
    if not rotated:
        return None
    return _gathered(state, rotated)


def _rotated_written(model, state: dict, adapters: list[str], save_embedding_layers) -> list[str]:
    """The names in `state` (a state dict of `model`, a PeftModel) of the rotated tensors PEFT's save_pretrained
    would write for `adapters`, sorted: the same list on every rank, computed without communicating. PEFT's own
    selection (`get_peft_model_state_dict`) picks them, DTensors untouched; a rotated tensor it selects that is no
    value of `state` is refused, on every rank alike."""
    from peft.utils import get_peft_model_state_dict

    by_id: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_id.setdefault(id(tensor), []).append(name)
    names: set[str] = set()
    for adapter in adapters:
        written = get_peft_model_state_dict(
            model, state_dict=state, adapter_name=adapter, save_embedding_layers=save_embedding_layers
        )
        rotated = sorted(name for name, t in written.items() if isinstance(t, DTensor))
        missing = [name for name in rotated if id(written[name]) not in by_id]
        if missing:
            raise RotatedStateError(f"PEFT writes rotated tensors hf_rtp cannot trace back to the model: {missing[:4]}")
        names.update(n for name in rotated for n in by_id[id(written[name])])
    return sorted(names)


def _gathered(state: dict, names: list[str]) -> dict:
    """Collective: `state` with the tensors under `names` gathered whole (each tensor once, in `names`' order,
    which must be every rank's), aliases kept aliases as in vanilla's state dict."""
    state = dict(state)
    whole_of: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name in names:
            tensor = state[name]
            if id(tensor) not in whole_of:
                whole_of[id(tensor)] = tensor.full_tensor()
            state[name] = whole_of[id(tensor)]
    return state


_SAVE_CALL = "PeftModel.save_pretrained"


def _stand_in_for_save_pretrained() -> None:
    """`peft.PeftModel.save_pretrained` on a model hf_rtp loaded, where what PEFT writes holds rotated tensors (the
    trainable copy `modules_to_save` makes of a rotated head or embedding; the embeddings with save_embedding_layers):
    PEFT read their storage to write them, and each rank holds only its rows, so the save was refused after every
    rank had written the folder's README.md. Here it is collective, as the base model's save_pretrained: every rank
    calls it, they meet (a rank that does not is named within the entry timeout), gather those tensors whole, and
    the writer alone (ring rank 0 of the first replica) runs PEFT's save with them, as vanilla PEFT writes the same
    adapter; the other ranks run it with is_main_process=False (vanilla's: nothing written), and a failure on the
    writer is an error on every rank. `is_main_process=False` on every rank writes nothing, as in vanilla. Where
    PEFT writes no rotated tensor (adapters alone: replicated; or a `state_dict=` gathered already), PEFT's own
    save runs unchanged, on whichever ranks call it."""
    from peft import PeftModel

    original = PeftModel.save_pretrained
    if getattr(original, _MARK, None) is not None:
        return
    signature = inspect.signature(original)
    extra = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    if extra is None or not {"selected_adapters", "save_embedding_layers", "is_main_process"} <= set(
        signature.parameters
    ):
        return  # another PEFT's save: left as it is (a rotated tensor in it is refused when PEFT reads its storage)

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        from ..model.state import state_of

        state = state_of(self, required=False)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        adapters = arguments["selected_adapters"]
        adapters = list(self.peft_config) if adapters is None else adapters
        if state is None or any(a not in self.peft_config for a in adapters):
            return original(self, *args, **kwargs)  # not hf_rtp's, or PEFT's own error for an unknown adapter
        given = arguments[extra].get("state_dict")
        whole_state = self.state_dict() if given is None else given
        rotated = _rotated_written(self, whole_state, adapters, arguments["save_embedding_layers"])
        if not rotated:
            return original(self, *args, **kwargs)
        topology = state.topology
        chosen = zlib.crc32("\n".join(rotated).encode())
        everyone = topology.enter(
            "PeftModel.save_pretrained", payload=[int(bool(arguments["is_main_process"])), len(rotated), chosen]
        )
        if len({tuple(row[1:3]) for row in everyone}) > 1:  # the same rows on every rank: all raise alike
            raise RotatedStateError(
                f"{_SAVE_CALL}: ranks would write different rotated tensors ({len(rotated)} on this rank: "
                f"{rotated[:4]}): every rank must save the same adapters of the same model, with the same "
                "selected_adapters and save_embedding_layers"
            )
        writes = any(row[0] for row in everyone)  # no rank the main process: vanilla writes nothing
        if writes:
            arguments[extra] = {**arguments[extra], "state_dict": _gathered(whole_state, rotated)}
        arguments["is_main_process"] = writes and topology.is_writer
        with agreed(topology.control, CheckpointError):  # the writer's failure is every rank's error
            original(*bound.args, **bound.kwargs)
        return None

    setattr(save_pretrained, _MARK, f"peft.{PeftModel.__qualname__}.save_pretrained")
    PeftModel.save_pretrained = save_pretrained  # the stand-in, see its docstring


def _stand_in_for_trainable_tokens() -> None:
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    update, forward = TrainableTokensLayer.update_layer, TrainableTokensLayer.forward_adapters
    if getattr(update, _MARK, None) is not None:
        return

    @functools.wraps(update)
    def update_layer(self, adapter_name, config=None, tied_adapter=None, **kwargs):
        weight = self.get_base_layer().weight
        if tied_adapter is not None or not isinstance(weight, RotatedTensor):
            return update(self, adapter_name, config, tied_adapter, **kwargs)
        indices = config.token_indices if config is not None else kwargs["token_indices"]
        init_weights = config.init_weights if config is not None else kwargs.get("init_weights", True)
        self.token_indices[adapter_name] = indices
        originals = rows_of(weight, list(indices))
        values = (
            originals if init_weights else torch.randn(originals.shape, dtype=originals.dtype, device=originals.device)
        )
        self.trainable_tokens_delta[adapter_name] = nn.Parameter(values.clone(), requires_grad=True)
        self.trainable_tokens_original[adapter_name] = originals.detach().clone()
        self._move_adapter_to_device_of_base_layer(adapter_name)

    @functools.wraps(forward)
    def forward_adapters(self, x, active_adapters, *args, **kwargs):
        base = self.base_layer
        if (
            not isinstance(base, (RotatedEmbedding, RotatedLinear))
            or self.disable_adapters
            or not active_adapters
            or self.merged
        ):
            return forward(self, x, active_adapters, *args, **kwargs)
        self._check_overlapping_tokens(active_adapters)
        result = base(x, *args, **kwargs)
        for adapter in active_adapters:
            indices = self.token_indices[adapter]
            index = torch.tensor(indices, device=result.device)
            delta = self.trainable_tokens_delta[adapter].to(local(base.weight))  # as PEFT's `.to(W)`
            if isinstance(base, RotatedEmbedding):
                hit = x.unsqueeze(-1) == index
                # vanilla's padding row gets no gradient: neither does its trainable copy
                padding = indices.index(base.padding_idx) if base.padding_idx in indices else None
                rows = F.embedding(hit.to(torch.int64).argmax(-1), delta, padding_idx=padding)
                scale = self._get_embed_scale()
                if scale is not None:
                    rows = rows * scale.to(rows.dtype)
                result = torch.where(hit.any(-1, keepdim=True), rows.to(result.dtype), result)
            else:  # a tied head: the trainable rows' logits
                result = result.index_copy(-1, index, F.linear(x, delta).to(result.dtype))
        return result

    for stand_in, name in ((update_layer, "update_layer"), (forward_adapters, "forward_adapters")):
        setattr(stand_in, _MARK, f"peft.tuners.trainable_tokens.layer.TrainableTokensLayer.{name}")
        setattr(TrainableTokensLayer, name, stand_in)


_MERGE_REFUSED = (
    "merging {what} into a rotated layer is not supported: PEFT merges with whole-matrix arithmetic that a rotated "
    "weight does not hold. Save the adapter (Trainer.save_model, or model.save_pretrained(dir) on every rank), then "
    "merge it in vanilla: "
    "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir).merge_and_unload()"
)


def _subclasses(root: type) -> list[type]:
    """`root` and every class below it, as imported now."""
    found, stack = [], [root]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


def _on_rotated_base(layer) -> bool:
    base = layer.get_base_layer()
    return isinstance(base, FrozenQuantizedLinear) or isinstance(getattr(base, "weight", None), RotatedTensor)


# LoRA initialisations that read the whole base weight (an SVD, a QR, a quantization, gradients) and rewrite it
_BASE_READING_INITS = ("pissa_init", "corda_init", "olora_init", "mica_init", "loftq_init", "lora_ga_init")
_INIT_REFUSED = (
    "LoraConfig(init_lora_weights={what!r}) on a rotated layer is not supported: PEFT computes it from the whole "
    "base weight (and most such inits rewrite that weight), and each rank holds only its rows (it crashed, or "
    "would be wrong). Initialise the adapter with PEFT on a vanilla model and save it (with the base weights it "
    "rewrote, if any), then load that base with hf_rtp.from_pretrained and the adapter with "
    "PeftModel.from_pretrained(model, dir, low_cpu_mem_usage=True)"
)


def _computes_from_the_base(layer, name: str, args: tuple) -> bool:
    """Whether PEFT's init `name` would compute from the base weight now: not where it leaves the adapter to a
    checkpoint (MiCA's on the meta device, low_cpu_mem_usage; LoRA-GA's without the gradients it was prepared
    with), the way an adapter is loaded."""
    if name == "mica_init" and args:  # an embedding's B is a parameter of its own, a linear's a module's weight
        embedded = getattr(layer, "lora_embedding_B", {})
        held = embedded[args[0]] if args[0] in embedded else layer.lora_B[args[0]].weight
        return held.device.type != "meta"
    if name == "lora_ga_init":
        return hasattr(layer.get_base_layer(), "_peft_loraga_grad")
    return True


def _refuse_inits_that_read_the_base() -> None:
    from peft.tuners.lora.layer import LoraLayer

    for cls in _subclasses(LoraLayer):  # with every subclass's own (LoRA's Embedding has a mica_init of its own)
        for name in _BASE_READING_INITS:
            original = cls.__dict__.get(name)
            if original is None or getattr(original, _MARK, None) is not None:
                continue

            def refusing(self, *args, _original=original, _name=name, **kwargs):
                if _on_rotated_base(self) and _computes_from_the_base(self, _name, args):
                    what = args[1] if _name in ("pissa_init", "corda_init") and len(args) > 1 else _name[:-5]
                    raise RotatedStateError(_INIT_REFUSED.format(what=what))
                return _original(self, *args, **kwargs)

            functools.update_wrapper(refusing, original)
            setattr(refusing, _MARK, f"{cls.__module__}.{cls.__qualname__}.{name}")
            setattr(cls, name, refusing)  # a refusal on rotated layers; PEFT's own everywhere else


# tuner layers whose merge into a rotated layer was compared with vanilla PEFT's and is left to PEFT (not LoRA's
# variants, `_refuse_merge`); every other tuner's merge is refused on a rotated layer: DoRA's, trainable tokens', IA3's,
# OFT's and BOFT's gave wrong weights without an error
_MERGES_COMPARED = ("peft.tuners.lora.", "peft.tuners.loha.", "peft.tuners.lokr.")


def _refuse_merge(layer, adapter_names) -> None:
    """A merge into a rotated layer that was not compared with vanilla PEFT's, or that gave wrong weights: refused."""
    variants = getattr(layer, "lora_variant", None) or {}
    chosen = [a for a in (adapter_names or layer.active_adapters) if a in variants]
    if chosen:  # DoRA and the other variants, on any LoRA layer
        raise RotatedStateError(_MERGE_REFUSED.format(what=f"{type(variants[chosen[0]]).__name__} adapters"))
    if isinstance(layer.get_base_layer(), FrozenQuantizedLinear):
        raise RotatedStateError(_MERGE_REFUSED.format(what="adapters on a 4-bit or 8-bit base (quantization_config)"))
    if not type(layer).__module__.startswith(_MERGES_COMPARED):
        raise RotatedStateError(_MERGE_REFUSED.format(what=f"{type(layer).__name__} ({type(layer).__module__})"))


def _refuse_merges_not_compared() -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for cls in _subclasses(BaseTunerLayer):
        original = cls.__dict__.get("merge")
        if original is None or getattr(original, _MARK, None) is not None:
            continue

        def merge(self, *args, _original=original, **kwargs):  # by the layer's own class: LoHa's merge is Lycoris'
            if _on_rotated_base(self):
                _refuse_merge(self, kwargs.get("adapter_names", args[1] if len(args) > 1 else None))
            return _original(self, *args, **kwargs)

        functools.update_wrapper(merge, original)
        setattr(merge, _MARK, f"{cls.__module__}.{cls.__qualname__}.merge")
        setattr(cls, "merge", merge)  # noqa: B010


_EVA_REFUSED = (
    "initialize_lora_eva_weights(..., gather_distributed_inputs=False) (or get_eva_state_dict) with different batches "
    "on different ranks is not supported on a rotated model: each rank would run EVA's loop until its own SVD "
    "converges, after its own number of forwards, and a rotated forward is collective. Keep "
    "gather_distributed_inputs=True (the default: every rank's batches gathered, as vanilla PEFT does under "
    "torch.distributed), give every rank the same batches, or compute get_eva_state_dict on a vanilla model and "
    "pass eva_state_dict=..."
)


_EVA_APART = (
    "initialize_lora_eva_weights(..., gather_distributed_inputs=False) on a rotated model: ranks given the same "
    "batches {what}. Keep gather_distributed_inputs=True (the default), or compute get_eva_state_dict on a vanilla "
    "model and pass eva_state_dict=..."
)
_UNCOMPARED = -1  # a batch digest for a batch holding a value _batch_digest cannot compare across ranks


def _batch_digest(inputs) -> tuple[int, str]:
    """A checksum of a batch, equal on ranks given the same batch wherever its tensors live: tensors' and numpy
    arrays' dtypes, shapes and bytes, mappings (BatchEncoding too) by key, sequences in order, plain values by value.
    Other values (an object's repr may hold its address, a large array's elides values) give _UNCOMPARED and the
    type that was not compared. Copies each tensor to the host: EVA's batches are token ids, once per forward."""
    crc = 0

    def add(data: bytes) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)

    def walk(value) -> str | None:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.device.type == "meta":
                return f"a {value.layout} tensor on {value.device.type}"
            value = value.detach().resolve_conj().resolve_neg().cpu().contiguous()
            add(f"tensor {value.dtype} {tuple(value.shape)}".encode())
            add(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, numpy.ndarray):
            if value.dtype.hasobject:
                return "a numpy array of objects"
            add(f"array {value.dtype} {value.shape}".encode())
            add(numpy.ascontiguousarray(value).tobytes())
        elif isinstance(value, Mapping):
            add(f"mapping {len(value)}".encode())
            for key in sorted(value, key=repr):
                add(repr(key).encode())
                if (missed := walk(value[key])) is not None:
                    return missed
        elif isinstance(value, (list, tuple)):
            add(f"sequence {len(value)}".encode())
            for item in value:
                if (missed := walk(item)) is not None:
                    return missed
        elif value is None or isinstance(value, (str, bytes, int, float, complex)):
            add(repr(value).encode())
        else:
            return type(value).__name__
        return None

    missed = walk(inputs)
    return (_UNCOMPARED, missed) if missed is not None else (crc, "")


def _stand_in_for_eva() -> None:
    """EVA's loop (`peft.tuners.lora.eva._get_eva_state_dict`, behind `get_eva_state_dict` and
    `initialize_lora_eva_weights`) runs forwards until every layer's SVD of its inputs converges. By default PEFT
    gathers every rank's layer inputs, so every rank converges after the same forwards, and hf_rtp gives vanilla's
    adapters. With `gather_distributed_inputs=False` each rank converges on its own batches, after its own number of
    forwards: on a rotated model, whose forwards are collective, ranks given different batches fell out of step and
    failed after the entry timeout, without naming EVA. There every EVA forward first meets the other ranks with a
    checksum of its batch: the same batches go on (vanilla's adapters), different ones are refused on every rank at
    the first forward whose batches differ; and the ranks meet once more when their loop ends, so ranks that
    converged after different numbers of forwards fail together, naming it."""
    try:
        from peft.tuners.lora import eva
    except ImportError:
        return
    original = getattr(eva, "_get_eva_state_dict", None)
    if original is None or getattr(original, _MARK, None) is not None:
        return
    signature = inspect.signature(original)
    if not {"model", "forward_fn", "gather_distributed_inputs"} <= set(signature.parameters):
        return  # another PEFT's loop: left as it is (a forward out of step still fails at hf_rtp's meeting)
    forwarding, done = 0, 1  # what a rank brings to EVA's meeting

    def get_eva_state_dict(*args, **kwargs):
        from ..model.state import state_of

        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        state = state_of(bound.arguments["model"], required=False)
        if state is None or state.topology.world_size == 1 or bound.arguments["gather_distributed_inputs"]:
            return original(*args, **kwargs)
        topology, forward = state.topology, bound.arguments["forward_fn"]

        def meet(kind: int, digest: int = 0) -> list[list[int]]:
            everyone = topology.enter("initialize_lora_eva_weights", payload=[kind, digest])
            if len({row[0] for row in everyone}) > 1:  # the same rows on every rank: every rank raises alike
                ended = [r for r, row in enumerate(everyone) if row[0] == done]
                raise CollectiveMisuseError(
                    _EVA_APART.format(what=f"converged after different numbers of forwards (ranks {ended} first)")
                )
            return everyone

        def forward_on_the_same_batch(model, inputs):
            digest, missed = _batch_digest(inputs)
            digests = [row[1] for row in meet(forwarding, digest)]
            if _UNCOMPARED in digests:
                held = f"{missed} on this rank" if missed else f"on rank {digests.index(_UNCOMPARED)}"
                raise RotatedStateError(f"{_EVA_REFUSED} (a batch holds a value hf_rtp cannot compare: {held})")
            if len(set(digests)) > 1:
                raise RotatedStateError(_EVA_REFUSED)
            return forward(model, inputs)

        bound.arguments["forward_fn"] = forward_on_the_same_batch
        found = original(*bound.args, **bound.kwargs)
        meet(done)
        return found

    functools.update_wrapper(get_eva_state_dict, original)
    setattr(get_eva_state_dict, _MARK, "peft.tuners.lora.eva._get_eva_state_dict")
    eva._get_eva_state_dict = get_eva_state_dict  # called by its module's global name
