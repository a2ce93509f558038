"""Prometheus exposition text to ``Samples``: the library's parser, and a faster path for a
replica's successive scrapes.

``parse_exposition`` reads one scrape with prometheus_client (``_created`` samples and non-finite
values dropped; ``ExpositionError`` when any line is invalid: a scrape with a bad line is a failed
scrape, as in Prometheus). ``ExpositionParser`` gives the same result for one replica's scrapes
while reading only the values when the lines are laid out as last time. Synchronous, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.replicas.dialects import Samples

__all__ = ["ExpositionError", "ExpositionParser", "parse_exposition"]


class ExpositionError(ValueError):
    """The text is not Prometheus exposition format (the parser rejected it)."""


def parse_exposition(text: str) -> Samples:
    """Parse Prometheus text with prometheus_client; ``_created`` samples and NaN/inf values dropped.

    Raises ``ExpositionError`` (one line, the parser's complaint) when any line is invalid: like
    Prometheus, a scrape with a bad line is a failed scrape, not a partial one.
    """
    return Samples(_kept((s.name, s.labels, s.value) for s in _library_samples(text)))


def _library_samples(text: str) -> list[Sample]:
    """Every sample prometheus_client's parser reads in ``text``, in line order (its families
    are yielded in line order, their samples in line order); ``ExpositionError`` when it rejects
    the text."""
    try:
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (ValueError, TypeError, IndexError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise ExpositionError(f"not Prometheus text: {first_line[:200]}") from exc


_Series = tuple[str, Mapping[str, str], float]


def _kept(samples: Iterable[_Series]) -> list[_Series]:
    """The samples ``Samples`` holds: a counter's ``_created`` (a start timestamp, ~1.8e9, not a
    count) and non-finite values left out."""
    return [
        (name, labels, float(value))
        for name, labels, value in samples
        if not name.endswith("_created") and math.isfinite(value)
    ]


def _value(text: str) -> float:
    """A sample value as prometheus_client's text parser reads it, as a float; ``ValueError`` for
    text it rejects (it refuses ``_`` digit separators, then tries ``int()`` and ``float()``:
    ``float()`` reads every integer text to the same number)."""
    if "_" in text:
        raise ValueError(f"invalid value: {text!r}")
    return float(text)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclass(frozen=True, slots=True)
class _Layout:
    """What one scrape's lines were to prometheus_client's parser, by position (``ExpositionParser``)."""

    #: Every line, stripped, up to its last space (the whole line when it has none).
    heads: list[str]
    #: (position, the rest after the last space) of every comment and blank line: these must match
    #: whole, not by head (``# TYPE x counter`` against ``# TYPE x gauge``).
    fixed: list[tuple[int, str]]
    #: Position of every sample line, in order; its value is the text after its last space.
    positions: list[int]
    #: The library's samples by sample name: (labels, index into ``positions``), ``_created``
    #: samples left out, as ``Samples`` groups them.
    groups: dict[str, list[tuple[Mapping[str, str], int]]]


class ExpositionParser:
    """``parse_exposition`` for one replica's successive scrapes, without parsing every line again.

    prometheus_client's parser reads a line character by character, in a worker thread that
    holds the GIL, so the event loop waits for it (costs: ``bench.scrape_parse``, results in
    docs/benchmarks.md). A replica's scrapes
    differ in their values and rarely in anything else, so the layout of a parsed scrape is kept:
    each line up to its last space, and the name and labels the library read from each sample
    line. A scrape whose lines are the same up to their last space, and whose comment lines are
    the same whole, reuses it and reads only the values; any other scrape goes to the library.

    The result is the library's, always (property-tested against it): a layout is kept only if
    the library read every sample line's value as the text after its last space reads, with no
    timestamp, so a scrape with a timestamp, an exemplar or a tab before a value always takes the
    library's path. A value the fast path cannot read sends the scrape to the library too, which
    raises ``ExpositionError`` as ``parse_exposition`` does, and the layout is forgotten.

    One per replica (the scraper parses a replica's scrapes one at a time, in a worker thread). A
    kept layout is never changed, only replaced, so a parse left running in its thread by a
    cancelled scrape cannot corrupt the next one's; it costs the library's parse and 2-10 % more
    when the layout does not fit.
    """

    __slots__ = ("_layout", "hits", "misses")

    def __init__(self) -> None:
        self._layout: _Layout | None = None
        #: Scrapes read with the kept layout, and by the library.
        self.hits = 0
        self.misses = 0

    def parse(self, text: str) -> Samples:
        """``parse_exposition(text)``; see the class docstring."""
        parts = [line.strip().rpartition(" ") for line in text.split("\n")]
        layout = self._layout
        if layout is not None:
            samples = _read(layout, parts)
            if samples is not None:
                self.hits += 1
                return samples
        self.misses += 1
        self._layout = None
        library = _library_samples(text)
        self._layout = _layout_of(parts, library)
        return Samples(_kept((s.name, s.labels, s.value) for s in library))


def _read(layout: _Layout, parts: list[tuple[str, str, str]]) -> Samples | None:
    """The samples of a scrape split into ``parts`` with ``layout``; ``None`` when it does not fit
    it or a value does not read (the library decides then)."""
    if len(parts) != len(layout.heads) or [p[0] for p in parts] != layout.heads:
        return None
    if any(parts[i][2] != rest for i, rest in layout.fixed):
        return None
    tails = [parts[i][2] for i in layout.positions]
    if "_" in "".join(tails):  # ``_value`` on every tail, in two passes instead of a call each
        return None
    try:
        values = list(map(float, tails))
    except ValueError:
        return None
    groups = layout.groups
    if math.isfinite(sum(values)):  # (a sum that overflows takes the careful way too)
        by_name = {name: [(labels, values[i]) for labels, i in members] for name, members in groups.items()}
    else:  # a NaN or an infinity somewhere: leave those out, as ``_kept`` does
        by_name = {
            name: kept
            for name, members in groups.items()
            if (kept := [(labels, values[i]) for labels, i in members if math.isfinite(values[i])])
        }
    return Samples.grouped(by_name)


def _layout_of(parts: list[tuple[str, str, str]], library: list[Sample]) -> _Layout | None:
    """The layout of a scrape the library read as ``library``; ``None`` when its lines cannot be
    read back as the library read them (see ``ExpositionParser``)."""
    heads: list[str] = []
    fixed: list[tuple[int, str]] = []
    positions: list[int] = []
    groups: dict[str, list[tuple[Mapping[str, str], int]]] = {}
    found = iter(library)
    try:
        for index, (head, space, rest) in enumerate(parts):
            heads.append(head)
            if not space or not head or head[0] == "#":
                if not space and rest and rest[0] != "#":
                    return None  # a sample line with no space before its value
                fixed.append((index, rest))
                continue
            sample = next(found)
            if sample.timestamp is not None or not _same(_value(rest), float(sample.value)):
                return None
            if not sample.name.endswith("_created"):
                groups.setdefault(sample.name, []).append((sample.labels, len(positions)))
            positions.append(index)
    except (StopIteration, ValueError):
        return None
    if next(found, None) is not None:
        return None
    return _Layout(heads, fixed, positions, groups)
