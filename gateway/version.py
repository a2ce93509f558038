"""Sluice's own version, read from the installed package's metadata (``pyproject.toml``'s
``project.version``), so that ``sluice --version`` and ``/openapi.json`` cannot drift from it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["DISTRIBUTION", "UNKNOWN_VERSION", "package_version"]

#: The distribution name Sluice is installed under.
DISTRIBUTION: Final = "sluice"
#: What ``package_version`` answers when Sluice runs from sources that were never installed.
UNKNOWN_VERSION: Final = "0+unknown"


def package_version() -> str:
    """The installed version of Sluice (``"0.1.0"``), or ``UNKNOWN_VERSION`` when its metadata is
    absent (the sources run without ``pip install``). Reads the metadata on each call."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN_VERSION
