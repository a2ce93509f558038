"""``bench.live_accuracy.ttft_by_load``: requests in flight at each dispatch, and the best
forecast that knows only that count."""

from __future__ import annotations

from bench.live_accuracy import Sample, ttft_by_load


def _sample(
    rid: str, sent_at: float, ttft_s: float, tokens: int, tpot_s: float, predicted_s: float
) -> Sample:
    return Sample(
        request_id=rid,
        sent_at=sent_at,
        prompt_chars=100,
        max_tokens=tokens,
        status=200,
        replica="r",
        prediction="ok",
        predicted_ttft_s=predicted_s,
        predicted_tpot_s=tpot_s,
        client_ttft_s=ttft_s,
        client_tpot_s=tpot_s,
        completion_tokens=tokens,
        gateway_ttft_s=ttft_s,
    )


def test_counts_the_requests_in_flight_and_scores_the_count_alone() -> None:
    # "a" runs from 0.0 to 0.0 + 0.010 + 9 x 0.010 = 0.100 s; "b" is sent inside it, "c" after it.
    a = _sample("a", 0.0, 0.010, 10, 0.010, 0.010)
    b = _sample("b", 0.050, 0.040, 2, 0.001, 0.020)
    c = _sample("c", 0.200, 0.010, 2, 0.001, 0.010)
    d = _sample("d", 0.300, 0.030, 2, 0.001, 0.010)
    text = ttft_by_load([a, b, c, d], [a, b, c, d])
    lines = text.splitlines()
    idle = next(line for line in lines if line.strip().startswith("0 in flight"))
    busy = next(line for line in lines if line.strip().startswith("1 in flight"))
    assert "n=   3" in idle  # a, c and d were sent with nothing else in flight
    assert "n=   1" in busy  # b, sent while a streamed
    assert "forecast    20.0" in busy
    # Idle: measured 10, 10, 30 ms, median 10 ms: errors 0, 0, 2/3; busy: its own median, 0.
    # Errors 0, 0, 0, 2/3: median 0, p90 (numpy's linear interpolation) 0.7 x 2/3 = 46.7 %.
    assert "median 0.0 %" in lines[-1]
    assert "p90 46.7 %" in lines[-1]


def test_no_forecast_no_rows() -> None:
    bare = Sample("x", 0.0, 100, 8, 200, "r", "ok", None, None, 0.01, 0.01, 8, 0.01)
    assert ttft_by_load([bare], [bare]) == "TTFT by requests in flight: no samples"
