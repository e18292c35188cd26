"""What a plan is: which modules rotate (and as what kind of op), which parameters stay whole.

Patterns are shell-style globs over dotted names (`model.layers.*.mlp.*_proj`). `resolve` checks
that every parameter of the model is covered exactly once, so a new architecture can never silently
train a parameter that no rule shards or synchronises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from ..errors import PlanError
from ..layers import LAYERS


@dataclass(frozen=True)
class Plan:
    rotate: Mapping[str, str]
    """module-name glob -> layer kind (a key of `hf_rtp.layers.LAYERS`)"""
    replicate: tuple[str, ...] = ()
    """parameter-name globs kept whole on every rank (norms, routers); their grads are averaged"""
    name: str = field(default="custom", compare=False)

    def resolve(self, model: nn.Module) -> Resolution:
        rotated: dict[str, str] = {}
        for module_name, module in model.named_modules():
            kinds = {kind for pattern, kind in self.rotate.items() if fnmatchcase(module_name, pattern)}
            if not kinds:
                continue
            if len(kinds) > 1:
                raise PlanError(f"plan '{self.name}': module {module_name} matches several kinds {sorted(kinds)}")
            kind = kinds.pop()
            if kind not in LAYERS:
                raise PlanError(f"plan '{self.name}': unknown layer kind '{kind}'; known kinds: {sorted(LAYERS)}")
            refusal = LAYERS[kind].refusal(module)
            if refusal is not None:
                raise PlanError(
                    f"plan '{self.name}': {module_name} is a {type(module).__name__}, but kind '{kind}' rotates "
                    f"{LAYERS[kind].replaces} modules only when it reproduces their forward exactly, and {refusal}. "
                    "Replicate its parameters instead, or register a plan without it"
                )
            nested = [n for n, _ in module.named_parameters() if "." in n]
            if nested:
                raise PlanError(f"plan '{self.name}': rotated module {module_name} has nested parameters {nested}")
            rotated[module_name] = kind

        rotated_params, replicated, uncovered, doubly = set(), [], [], []
        for name, _ in model.named_parameters(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            owner_kind = rotated.get(owner)
            is_rotated = owner_kind is not None and leaf in LAYERS[owner_kind].rotated_leaves
            # a rotated op's other parameters (Conv1D's bias, added after the summed partials) stay whole
            carried = owner_kind is not None and not is_rotated
            is_replicated = carried or any(fnmatchcase(name, pattern) for pattern in self.replicate)
            if is_rotated and is_replicated:
                doubly.append(name)
            elif is_replicated:
                replicated.append(name)
            elif is_rotated:
                rotated_params.add(name)
            else:
                uncovered.append(name)
        if doubly:
            raise PlanError(f"plan '{self.name}': parameters both rotated and replicated: {_listing(doubly)}")
        if uncovered:
            raise PlanError(
                f"plan '{self.name}' covers neither rotation nor replication for {len(uncovered)} parameter(s): "
                f"{_listing(uncovered)}. Add a rotate pattern for their module or a replicate pattern for them."
            )
        return Resolution(rotated=rotated, rotated_params=rotated_params, replicated=replicated)


@dataclass(frozen=True)
class Resolution:
    rotated: dict[str, str]
    """module name -> layer kind"""
    rotated_params: set[str]
    """parameter names cut along dim 0"""
    replicated: list[str]
    """parameter names"""
    transposed: set[str] = field(default_factory=set)
    """parameter names stored transposed: a GPT-2 Conv1D weight [in, out] loaded as a linear's [out, in], as
    vanilla's bitsandbytes quantizes it (integrations/bitsandbytes.py)"""


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
