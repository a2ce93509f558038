"""EventSplitter: whole events out, whatever the chunk boundaries and line endings."""

from __future__ import annotations

import pytest

from gateway.sse import Event, EventSplitter, encode_data, event_data

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
