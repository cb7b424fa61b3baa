"""The one way an adapter of ``gradclip.integrations`` imports its framework: lazily, and only a
release it is tested with (a framework's private paths move between releases; an adapter on an
untested one could clip nothing and say nothing)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Sequence

#: Set to 1 to use an adapter with a framework release it is not tested with.
OVERRIDE = "GRADCLIP_UNTESTED_FRAMEWORKS"


class UntestedFramework(ImportError):
    """A framework release that an adapter of ``gradclip.integrations`` is not tested with."""


def release(distribution: str) -> str:
    """The installed release of ``distribution`` (a pip name), or an ImportError saying it is missing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"gradclip's {distribution} adapter needs {distribution}, which is not installed: pip install {distribution}") from None


def require(module: str, distribution: str, tested: Sequence[str]):
    """``module`` imported, after checking that ``distribution``'s installed release is one of
    ``tested`` (major.minor releases: "0.19" takes 0.19.x): ``UntestedFramework`` otherwise,
    unless ``GRADCLIP_UNTESTED_FRAMEWORKS=1``."""
    have = release(distribution)
    minor = ".".join(have.split("+")[0].split(".")[:2])
    if minor not in tested and os.environ.get(OVERRIDE) != "1":
        raise UntestedFramework(
            f"gradclip's {distribution} adapter is tested with {distribution} {', '.join(tested)} and this is {have}: "
            f"install a tested release, or set {OVERRIDE}=1 to use it regardless (then check that the norm it logs "
            "is the one your run had)"
        )
    return importlib.import_module(module)
