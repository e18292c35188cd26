"""What a plan is: which modules rotate (and as what kind of op), which parameters stay whole.

Patterns are shell-style globs over dotted names (`model.layers.*.mlp.*_proj`). `resolve` checks
that every parameter of the model is covered exactly once, so a new architecture can never silently
train a parameter that no rule shards or synchronises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn

from ..layers import LAYERS


class PlanError(ValueError):
    """A plan does not fit the model it is applied to."""


@dataclass(frozen=True)
class Plan:
    rotate: Mapping[str, str]
    """module-name glob -> layer kind (a key of `hf_rtp.layers.LAYERS`)"""
    replicate: tuple[str, ...] = ()
    """parameter-name globs kept whole on every rank (norms, routers); their grads are averaged"""
    name: str = field(default="custom", compare=False)

    def resolve(self, model: nn.Module) -> "Resolution":
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
            vanilla_type = LAYERS[kind][0]
            if not isinstance(module, vanilla_type):
                raise PlanError(
                    f"plan '{self.name}': {module_name} is a {type(module).__name__}, "
                    f"but kind '{kind}' rotates {vanilla_type.__name__} modules"
                )
            rotated[module_name] = kind

        replicated, uncovered, doubly = [], [], []
        for name, _ in model.named_parameters(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            is_rotated = owner in rotated and leaf in ("weight", "bias")
            is_replicated = any(fnmatchcase(name, pattern) for pattern in self.replicate)
            if is_rotated and is_replicated:
                doubly.append(name)
            elif is_replicated:
                replicated.append(name)
            elif not is_rotated:
                uncovered.append(name)
        if doubly:
            raise PlanError(f"plan '{self.name}': parameters both rotated and replicated: {_listing(doubly)}")
        if uncovered:
            raise PlanError(
                f"plan '{self.name}' covers neither rotation nor replication for {len(uncovered)} parameter(s): "
                f"{_listing(uncovered)}. Add a rotate pattern for their module or a replicate pattern for them."
            )
        return Resolution(rotated=rotated, replicated=replicated)


@dataclass(frozen=True)
class Resolution:
    rotated: dict[str, str]
    """module name -> layer kind"""
    replicated: list[str]
    """parameter names"""


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
