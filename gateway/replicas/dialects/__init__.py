"""Metric dialects by name: each turns one engine family's ``/metrics`` into a canonical ``Reading``.

Adding an engine (TGI, SGLang) is one new module with a class satisfying ``Dialect`` and one entry
in ``DIALECTS``; the window arithmetic in ``gateway.replicas.scrape`` serves every dialect.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.replicas.dialects.base import (
    CounterName,
    Dialect,
    Gauges,
    Histogram,
    HistogramName,
    Reading,
    Samples,
)
from gateway.replicas.dialects.vllm import VllmDialect

__all__ = [
    "DIALECTS",
    "CounterName",
    "Dialect",
    "Gauges",
    "Histogram",
    "HistogramName",
    "Reading",
    "Samples",
    "VllmDialect",
    "get_dialect",
]

#: Every known dialect by its configured name.
DIALECTS: Mapping[str, Dialect] = MappingProxyType({d.name: d for d in (VllmDialect(),)})


def get_dialect(name: str) -> Dialect:
    """The dialect registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"unknown metrics dialect {name!r}; known: {', '.join(sorted(DIALECTS))}") from None
