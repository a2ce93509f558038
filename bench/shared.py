"""What several benchmarks share: their generated block of a doc, a process pool stand-in, and
settings merged into a generated configuration.

``write_block`` replaces the block between a benchmark's ``begin`` and ``end`` markers in a doc
(or appends it, under ``heading`` when given); ``InProcess`` is ``ProcessPoolExecutor``'s ``map``
run in this process (``--jobs 1``, and the smoke tests); ``parse_variant`` reads a
``--variant LABEL=JSON`` and ``merge_settings`` merges its settings into a configuration.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["InProcess", "merge_settings", "parse_variant", "write_block"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def write_block(doc: Path, generated: str, begin: str, end: str, *, heading: str | None = None) -> None:
    """Replace the block of ``doc`` from ``begin`` to ``end`` with ``generated`` (which carries
    both markers); without the markers, append it at the end (after ``heading``, when given). A
    missing ``doc`` starts as ``# Benchmarks``."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + generated + tail
    else:
        section = generated if heading is None else f"{heading}\n\n{generated}"
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text, encoding="utf-8")


class InProcess:
    """``ProcessPoolExecutor``'s ``map`` in this process (``--jobs 1``, and the smoke tests)."""

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> Iterator[_R]:
        return map(fn, items)


def merge_settings(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged in: mappings key by key, recursively; anything else replaced."""
    merged = dict(base)
    for key, value in patch.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_settings(old, value)
        else:
            merged[key] = value
    return merged


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``--variant LABEL=JSON`` as ``(label, settings)``; raises ``ValueError`` (its message for the
    command line's usage error) when the label is empty or the settings are not a JSON object."""
    label, _, text = spec.partition("=")
    try:
        patch = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--variant {spec}: the settings are not JSON ({exc})") from None
    if not label or not isinstance(patch, dict):
        raise ValueError(f"--variant {spec}: want LABEL=JSON with a JSON object")
    return label, patch
