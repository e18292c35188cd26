"""Look up a library's private name, or fail naming it (see the package's text)."""

from __future__ import annotations

import functools
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import IntegrationError


@functools.cache  # lookups run on hot paths (each fused forward): parse the versions once per name
def check_version(library: str, installed: str, tested: str, name: str) -> None:
    """IntegrationError naming `name` when `installed` lies outside the `tested` specifier."""
    if Version(installed) not in SpecifierSet(tested):
        raise IntegrationError(
            f"hf_rtp relies on {library}'s private {name}, checked against {library}{tested}; "
            f"{library} {installed} is installed. Install {library}{tested}, or an hf_rtp release that supports "
            f"{library} {installed}"
        )


def lookup(root: Any, path: str, library: str, installed: str, tested: str) -> Any:
    """`root.<path>` (dotted), after check_version; IntegrationError naming the name if it is gone."""
    check_version(library, installed, tested, path)
    found = root
    for part in path.split("."):
        if not hasattr(found, part):
            raise IntegrationError(
                f"hf_rtp relies on {library}'s private {path}, which {library} {installed} does not have "
                f"(checked against {library}{tested})"
            )
        found = getattr(found, part)
    return found
