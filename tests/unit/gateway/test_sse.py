"""EventSplitter: whole events out, whatever the chunk boundaries and line endings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.sse import Event, EventSplitter, encode_data, event_data, event_data_fields

VLLM_STREAM = (
    b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
    b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n'
    b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED_DATA = [
    '{"choices": [{"delta": {"content": "Hel"}}]}',
    '{"choices": [{"delta": {"content": "lo"}}]}',
    '{"choices": [], "usage": {"prompt_tokens": 3}}',
    "[DONE]",
]


def feed_all(chunks: list[bytes]) -> tuple[list[Event], bytes]:
    splitter = EventSplitter()
    events = [event for chunk in chunks for event in splitter.feed(chunk)]
    return events, splitter.pending


def test_every_single_cut_point_gives_the_same_events() -> None:
    for cut in range(len(VLLM_STREAM) + 1):
        events, pending = feed_all([VLLM_STREAM[:cut], VLLM_STREAM[cut:]])
        assert [e.data for e in events] == EXPECTED_DATA, f"cut at byte {cut}"
        assert pending == b""


def test_one_byte_at_a_time() -> None:
    events, _ = feed_all([VLLM_STREAM[i : i + 1] for i in range(len(VLLM_STREAM))])
    assert [e.data for e in events] == EXPECTED_DATA
    assert b"".join(e.raw for e in events) == VLLM_STREAM


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        pytest.param([b"data: a\r\n\r\ndata: b\r\n\r\n"], ["a", "b"], id="crlf"),
        pytest.param([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"], ["a", "b"], id="crlf-split-inside"),
        pytest.param([b"data: a\r\rdata: b\r\r"], ["a", "b"], id="lone-cr"),
        pytest.param([b"data: a\ndata: b\n\n"], ["a\nb"], id="multi-line-data"),
        pytest.param([b"data:a\n\n"], ["a"], id="no-space-after-colon"),
        pytest.param([b": ping\n\ndata: a\n\n"], [None, "a"], id="comment-event-kept"),
        pytest.param([b"\n\n\ndata: a\n\n"], ["a"], id="leading-blank-lines-skipped"),
        pytest.param([b"event: x\nid: 1\ndata: a\n\n"], ["a"], id="other-fields"),
        pytest.param([b"data\n\n"], [""], id="empty-data-field"),
    ],
)
def test_splitting_cases(chunks: list[bytes], expected: list[str | None]) -> None:
    events, _ = feed_all(chunks)
    assert [e.data for e in events] == expected
    assert all(e.raw.endswith(b"\n\n") and b"\r" not in e.raw for e in events)


def test_an_unterminated_event_stays_pending() -> None:
    events, pending = feed_all([b"data: a\n\ndata: partial"])
    assert [e.data for e in events] == ["a"]
    assert pending == b"data: partial"


@pytest.mark.parametrize(
    ("raw", "data"),
    [
        pytest.param(b"data: x\n\n", "x", id="plain"),
        pytest.param(b"data:  two spaces\n\n", " two spaces", id="only-one-space-stripped"),
        pytest.param(b": comment\n\n", None, id="comment"),
        pytest.param(b"data: \xff\n\n", "\ufffd", id="invalid-utf8-replaced"),
    ],
)
def test_event_data(raw: bytes, data: str | None) -> None:
    assert event_data(raw) == data


def test_encode_data_round_trips() -> None:
    (event,), _ = feed_all([encode_data('{"a": 1}')])
    assert event.data == '{"a": 1}'


_LINES = st.sampled_from(
    [
        b'data: {"a": 1}',
        b"data:x",
        b"data",
        b": ping",
        b"event: e",
        b"id: 7",
        b"data:  two",
        b"data: \xff\xfe",
    ]
)
_ENDINGS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """An SSE stream (events of random fields, line endings, stray blank lines) and cut points,
    many of them at event boundaries (where a chunk is exactly one event: ``feed``'s fast path)."""
    stream = b""
    boundaries = []
    for _ in range(draw(st.integers(1, 6))):
        lines = draw(st.lists(_LINES, min_size=1, max_size=3))
        ending = draw(_ENDINGS)
        stream += draw(st.sampled_from([b"", b"\n"])) + ending.join(lines) + ending + ending
        boundaries.append(len(stream))
    cuts = draw(st.lists(st.sampled_from([*boundaries, *range(len(stream) + 1)]), max_size=8))
    return stream, sorted(set(cuts))


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_any_chunking_gives_the_events_of_one_byte_at_a_time(case: tuple[bytes, list[int]]) -> None:
    """Whole-event chunks take ``feed``'s and ``event_data``'s fast paths; one byte at a time
    takes neither: both give the same events (raw bytes and data) and the same pending tail."""
    stream, cuts = case
    bounds = [0, *cuts, len(stream)]
    chunked = feed_all([stream[a:b] for a, b in itertools.pairwise(bounds)])
    bytewise = feed_all([stream[i : i + 1] for i in range(len(stream))])
    assert chunked == bytewise


def test_a_chunk_of_one_whole_event_is_that_event() -> None:
    assert feed_all([b"data: x\n\n", b"data: y\n\n"]) == (
        [Event(b"data: x\n\n", "x"), Event(b"data: y\n\n", "y")],
        b"",
    )
    # Not the fast path: a held-back tail, a leading blank line, two events in one chunk.
    assert feed_all([b"data: a", b"\n\ndata: b\n\n"])[0] == [
        Event(b"data: a\n\n", "a"),
        Event(b"data: b\n\n", "b"),
    ]
    assert feed_all([b"\ndata: a\n\n"])[0] == [Event(b"data: a\n\n", "a")]


@settings(max_examples=300, deadline=None)
@given(st.lists(_LINES, min_size=1, max_size=3), st.binary(max_size=8))
def test_event_data_is_the_field_by_field_reading(lines: list[bytes], extra: bytes) -> None:
    """A one-line ``data: `` event takes ``event_data``'s fast path: the same value as reading
    it field by field (any bytes after ``data: ``, invalid UTF-8 included)."""
    for raw in (b"\n".join(lines) + b"\n\n", b"data: " + extra.replace(b"\n", b"") + b"\n\n"):
        assert event_data(raw) == event_data_fields(raw)
