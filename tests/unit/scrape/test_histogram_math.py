"""Counter increases and PromQL-style histogram quantiles, case by case."""

from __future__ import annotations

import math

import pytest

from gateway.replicas.dialects import Histogram
from gateway.replicas.scrape import (
    counter_increase,
    histogram_increase,
    histogram_mean,
    histogram_quantile,
)

INF = math.inf


def h(bounds: tuple[float, ...], cumulative: tuple[float, ...], total: float = 0.0) -> Histogram:
    return Histogram(
        bounds=bounds, cumulative=cumulative, sum=total, count=cumulative[-1] if cumulative else 0.0
    )


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        pytest.param(10.0, 15.0, 5.0, id="grows"),
        pytest.param(10.0, 10.0, 0.0, id="flat"),
        pytest.param(10.0, 3.0, 3.0, id="reset-post-value"),
        pytest.param(10.0, 0.0, 0.0, id="reset-to-zero"),
    ],
)
def test_counter_increase(previous: float, current: float, expected: float) -> None:
    assert counter_increase(previous, current) == expected


@pytest.mark.parametrize(
    ("q", "histogram", "expected"),
    [
        pytest.param(0.5, h((1, 2, INF), (10, 10, 10)), 0.5, id="lowest-bucket-starts-at-zero"),
        pytest.param(0.75, h((1, 2, 4, INF), (0, 10, 20, 20)), 3.0, id="interpolated-inside-bucket"),
        pytest.param(0.5, h((1, 2, INF), (5, 10, 10)), 1.0, id="rank-on-boundary-is-lower-bucket-top"),
        pytest.param(0.9, h((1, 2, INF), (1, 2, 10)), 2.0, id="in-inf-bucket-highest-finite-bound"),
        pytest.param(0.2, h((-1, 1, INF), (5, 10, 10)), -1.0, id="non-positive-lowest-bound-returned"),
        pytest.param(0.5, h((1, 2, INF), (5, 4.9999999, 10)), 1.0, id="dip-forced-monotonic"),
        pytest.param(0.0, h((1, 2, INF), (0, 4, 4)), 0.0, id="q0-empty-lowest-bucket"),
        pytest.param(1.0, h((1, 2, INF), (2, 4, 4)), 2.0, id="q1-top-of-last-filled-bucket"),
        pytest.param(0.5, h((1, 2), (5, 10)), None, id="no-inf-bucket"),
        pytest.param(0.5, h((INF,), (5,)), None, id="single-bucket"),
        pytest.param(0.5, h((1, INF), (0, 0)), None, id="no-observations"),
        pytest.param(0.5, h((), ()), None, id="no-buckets"),
    ],
)
def test_histogram_quantile_like_promql(q: float, histogram: Histogram, expected: float | None) -> None:
    got = histogram_quantile(q, histogram)

    assert got == (None if expected is None else pytest.approx(expected))


def test_quantile_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, h((1, INF), (1, 1)))


@pytest.mark.parametrize(
    ("previous", "current", "expected_cumulative", "expected_count"),
    [
        pytest.param(h((1, INF), (2, 3), 3.0), h((1, INF), (5, 7), 9.0), (3, 4), 4, id="grows"),
        pytest.param(h((1, INF), (2, 3), 3.0), h((1, INF), (1, 1), 0.5), (1, 1), 1, id="count-dropped-reset"),
        pytest.param(
            h((1, INF), (2, 3), 3.0), h((1, INF), (1, 4), 9.0), (1, 4), 4, id="bucket-dropped-reset"
        ),
        pytest.param(
            h((1, INF), (2, 3), 3.0), h((5, INF), (4, 4), 8.0), (4, 4), 4, id="layout-changed-reset"
        ),
    ],
)
def test_histogram_increase(
    previous: Histogram, current: Histogram, expected_cumulative: tuple[float, ...], expected_count: float
) -> None:
    step = histogram_increase(previous, current)

    assert (step.cumulative, step.count) == (expected_cumulative, expected_count)
    assert step.bounds == current.bounds


@pytest.mark.parametrize(
    ("histogram", "expected"),
    [
        pytest.param(Histogram((1, INF), (2, 4), 6.0, 4.0), 1.5, id="sum-over-count"),
        pytest.param(Histogram((1, INF), (0, 0), 0.0, 0.0), None, id="empty-unknown"),
        pytest.param(Histogram((), (), 6.0, 3.0), 2.0, id="mean-without-buckets"),
    ],
)
def test_histogram_mean(histogram: Histogram, expected: float | None) -> None:
    assert histogram_mean(histogram) == expected
