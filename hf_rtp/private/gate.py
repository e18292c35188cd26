"""Look up a library's private name, or fail naming it (see the package's text).

Which releases get what:
- inside the tested range (`TESTED`): the name is looked up, silently;
- older than the range (pyproject.toml's lower bound keeps pip from installing one): IntegrationError naming
  the name and the range, since hf_rtp relies on names those releases may lack or define otherwise;
- newer than the range (a release out after hf_rtp's, installed by the user): one warning per library and
  process, naming the tested range; then the name is looked up as usual, and one that is gone still fails
  with IntegrationError naming it. `.ci/newest` is how a newer release joins the tested range.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import IntegrationError


@functools.cache  # lookups run on hot paths (each fused forward): parse the versions once per name
def check_version(library: str, installed: str, tested: str, name: str) -> None:
    """IntegrationError naming `name` when `installed` is older than the `tested` specifier; a warning (once per
    library) when it is newer. Pre-releases and local builds (2.15.0+cu132, nightlies) count by their number."""
    version, specifier = Version(installed), SpecifierSet(tested)
    if specifier.contains(version, prereleases=True):
        return
    lowest = [s for s in specifier if s.operator == ">="]
    if any(not s.contains(version, prereleases=True) for s in lowest):
        raise IntegrationError(
            f"hf_rtp relies on {library}'s private {name}, checked against {library}{tested}; "
            f"{library} {installed} is older. Install {library}{tested}"
        )
    _newer(library, installed, tested)


@functools.cache
def _newer(library: str, installed: str, tested: str) -> None:
    # hf_rtp's logger on rank 0, as hf_rtp.log does; not through it: distributed/ reaches this module and must
    # not import transformers, which hf_rtp.log does
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    logging.getLogger("hf_rtp").warning(
        f"hf_rtp was tested with {library}{tested}; {library} {installed} is newer. Every private name hf_rtp uses is "
        "looked up and one that is gone fails naming it, but a name whose meaning changed would not: if results "
        f"differ from vanilla transformers', install {library}{tested} (hf_rtp's .ci/newest tests a newer release)"
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
