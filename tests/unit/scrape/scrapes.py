"""Scrape text for the tests: the real fixtures, and edited copies of them.

``ScrapeText`` parses a real scrape with prometheus_client, changes samples by known amounts
(counters bumped, histogram observations added bucket by bucket, families renamed to their old
names) and renders it back with prometheus_client's own exposition writer, so every synthetic
scrape is real exposition text derived from a real one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"

REAL_032 = "vllm-cpu-real-0.32.0.txt"
REAL_V0_010 = "vllm-v0-0.10-cpu-qwen3-full-scrape.txt"
AIBRIX_V0_07 = "vllm-v0-0.7-aibrix-runtime-docs.txt"
NIM_GREP = "vllm-v1-2026-nim-grep-cache-config-info.txt"
HYBRID_TRIMMED = "vllm-v1-2026-real-trimmed-prefix-cache-lines.txt"
DOCS_DESIGN = "vllm-v1-docs-design-metrics-example.txt"


def fixture_text(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def _matches(labels: Mapping[str, str], where: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in where.items())


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


class ScrapeText:
    """An immutable, editable scrape: every edit returns a new ``ScrapeText``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    @classmethod
    def parse(cls, text: str) -> ScrapeText:
        return cls(list(text_string_to_metric_families(text)))

    @classmethod
    def fixture(cls, name: str) -> ScrapeText:
        return cls.parse(fixture_text(name))

    def render(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self._families))
        return generate_latest(registry).decode("utf-8")

    def value(self, sample_name: str, **where: str) -> float:
        """Sum of the matching samples (test-side bookkeeping only)."""
        return math.fsum(
            s.value
            for f in self._families
            for s in f.samples
            if s.name == sample_name and _matches(s.labels, where)
        )

    def _edit(
        self, sample_name: str, where: Mapping[str, str], change: float, *, absolute: bool
    ) -> ScrapeText:
        families = copy.deepcopy(self._families)
        hit = 0
        for family in families:
            for i, s in enumerate(family.samples):
                if s.name == sample_name and _matches(s.labels, where):
                    family.samples[i] = s._replace(value=change if absolute else s.value + change)
                    hit += 1
        if not hit:
            raise KeyError(f"no sample {sample_name} {dict(where)}")
        return ScrapeText(families)

    def add(self, sample_name: str, delta: float, **where: str) -> ScrapeText:
        """Bump every matching sample by ``delta`` (a counter increase)."""
        return self._edit(sample_name, where, delta, absolute=False)

    def set(self, sample_name: str, value: float, **where: str) -> ScrapeText:
        """Set every matching sample to ``value`` (a gauge, or a counter after a restart)."""
        return self._edit(sample_name, where, value, absolute=True)

    def observe(self, base: str, value: float, n: int = 1, **where: str) -> ScrapeText:
        """Add ``n`` observations of ``value`` to histogram ``base`` (every bucket with le >= value)."""
        families = copy.deepcopy(self._families)
        touched = 0
        for family in families:
            for i, s in enumerate(family.samples):
                if not _matches(s.labels, where):
                    continue
                if s.name == base + "_bucket" and value <= float(s.labels["le"]):
                    family.samples[i] = s._replace(value=s.value + n)
                elif s.name == base + "_count":
                    family.samples[i] = s._replace(value=s.value + n)
                    touched += 1
                elif s.name == base + "_sum":
                    family.samples[i] = s._replace(value=s.value + n * value)
        if not touched:
            raise KeyError(f"no histogram {base} {dict(where)}")
        return ScrapeText(families)

    def reset_histogram(self, base: str) -> ScrapeText:
        """Zero histogram ``base`` (what a restarted engine exposes before any observation)."""
        families = copy.deepcopy(self._families)
        for family in families:
            for i, s in enumerate(family.samples):
                if s.name in (base + "_bucket", base + "_count", base + "_sum"):
                    family.samples[i] = s._replace(value=0.0)
        return ScrapeText(families)

    def rename(self, old: str, new: str) -> ScrapeText:
        """Rename family ``old`` (and its ``_created`` sibling) to ``new``: e.g. back to a V0 name."""
        families: list[Metric] = []
        for family in copy.deepcopy(self._families):
            if family.name == old or family.name.startswith(old + "_"):
                renamed = Metric(new + family.name[len(old) :], family.documentation, family.type)
                renamed.samples = [s._replace(name=new + s.name[len(old) :]) for s in family.samples]
                family = renamed
            families.append(family)
        return ScrapeText(families)

    def drop(self, *names: str) -> ScrapeText:
        """Remove families by name (their ``_created`` siblings too)."""
        kept = [f for f in self._families if not any(f.name == n or f.name == n + "_created" for n in names)]
        return ScrapeText(copy.deepcopy(kept))
