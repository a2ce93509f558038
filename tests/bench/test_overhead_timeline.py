"""``bench/overhead/timeline.py``'s event log arithmetic: requests are split at the first ``rx``
after an answer, offsets are from each request's ``rx``, and the gap row is the time from one
answer's last byte out to the next request's first byte in."""

from __future__ import annotations

from bench.overhead.timeline import requests_of, timeline


def test_requests_are_split_at_the_rx_after_an_answer() -> None:
    events = [
        ("stray before any request", 0.0, 0.0),
        ("rx", 1.0, 10.0),
        ("rx", 1.1, 10.0),  # more bytes of the same request
        ("stage >", 1.2, 10.1),
        ("tx to client", 1.5, 10.3),
        ("late work", 1.6, 10.4),
        ("rx", 2.0, 10.5),
        ("stage >", 2.4, 10.6),
        ("tx to client", 2.9, 10.9),
    ]
    first, second = requests_of(events)
    assert [e[0] for e in first] == ["rx", "rx", "stage >", "tx to client", "late work"]
    assert [e[0] for e in second] == ["rx", "stage >", "tx to client"]


def test_offsets_medians_and_the_gap() -> None:
    requests = [
        [("rx", 1.0, 5.0), ("stage >", 1.0001, 5.0001), ("tx to client", 1.0003, 5.0002)],
        [("rx", 2.0, 6.0), ("stage >", 2.0003, 6.0001), ("tx to client", 2.0005, 6.0004)],
        [("rx", 3.0, 7.0), ("stage >", 3.0002, 7.0002), ("tx to client", 3.0004, 7.0003)],
    ]
    rows = {label: (p50, cpu, n) for label, p50, _, cpu, n in timeline(requests)}
    assert rows["rx"] == (0.0, 0.0, 3)
    p50, cpu, n = rows["stage >"]
    assert round(p50) == 200  # median of 100, 300, 200 us
    assert round(cpu) == 100  # median of 100, 100, 200 us
    assert n == 3
    gap, gap_cpu, pairs = rows["(gap: last tx to client -> next request's rx)"]
    assert pairs == 2
    assert round(gap) == 999_600  # median of 999 700 and 999 500 us
    assert round(gap_cpu) == 999_700  # median of 999 800 and 999 600 us
    labels = [label for label, *_ in timeline(requests)]
    assert labels[-1].startswith("(gap")  # the gap row comes last
