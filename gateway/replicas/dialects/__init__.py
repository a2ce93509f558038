"""Metric dialects by name: each turns one engine family's ``/metrics`` into a canonical ``Reading``.

One module per engine (``vllm``, ``tgi``, ``sglang``), each a class satisfying ``Dialect`` with one
entry in ``DIALECTS``; the window arithmetic in ``gateway.replicas.scrape`` serves every dialect.
``backend: auto`` picks one per replica from what it answers (``gateway.replicas.dialects.detect``).
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
from gateway.replicas.dialects.detect import AUTO, INFO_PATHS, detect_from_samples, engine_from_info
from gateway.replicas.dialects.sglang import SglangDialect
from gateway.replicas.dialects.tgi import TgiDialect
from gateway.replicas.dialects.vllm import VllmDialect

__all__ = [
    "AUTO",
    "DIALECTS",
    "INFO_PATHS",
    "PREFIXES",
    "CounterName",
    "Dialect",
    "Gauges",
    "Histogram",
    "HistogramName",
    "Reading",
    "Samples",
    "SglangDialect",
    "TgiDialect",
    "VllmDialect",
    "detect",
    "engine_from_info",
    "get_dialect",
]

#: Every known dialect by its configured name.
DIALECTS: Mapping[str, Dialect] = MappingProxyType(
    {d.name: d for d in (VllmDialect(), TgiDialect(), SglangDialect())}
)
#: Each dialect's metric-name prefix, by dialect name.
PREFIXES: Mapping[str, str] = MappingProxyType({name: d.prefix for name, d in DIALECTS.items()})


def detect(samples: Samples) -> str | None:
    """The dialect most of ``samples``' names belong to; ``None`` when none does."""
    return detect_from_samples(samples, PREFIXES)


def get_dialect(name: str) -> Dialect:
    """The dialect registered as ``name``; ``ValueError`` naming the known ones otherwise
    (``"auto"`` is not a dialect: the scraper resolves it first)."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"unknown metrics dialect {name!r}; known: {', '.join(sorted(DIALECTS))}") from None
