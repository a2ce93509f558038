"""``bench.live_accuracy``'s verdicts: ``ErrorStats.met`` / ``verdict`` on hand-built errors, and
``error_stats`` on hand-built pairs."""

from __future__ import annotations

import math

import pytest

from bench.live_accuracy import TARGETS, ErrorStats, describe, error_stats, table_rows

NAN = math.nan
TPOT = TARGETS["tpot"]  # (0.10, 0.25)
TTFT = TARGETS["ttft"]  # (0.15, 0.35)

# stats, targets, met, verdict; the id names the case
CASES = [
    pytest.param(ErrorStats(100, 0.05, 0.20, 0.001, 0.004, 1.0), TPOT, True, "met", id="within"),
    pytest.param(
        ErrorStats(100, 0.10, 0.25, 0.001, 0.002, 1.0), TPOT, True, "met", id="on the line (inclusive)"
    ),
    pytest.param(ErrorStats(100, 0.11, 0.20, 0.001, 0.002, 1.1), TPOT, False, "NOT met", id="median outside"),
    pytest.param(ErrorStats(100, 0.05, 0.26, 0.001, 0.002, 1.0), TPOT, False, "NOT met", id="p90 outside"),
    pytest.param(ErrorStats(50, 0.14, 0.34, 0.003, 0.008, 1.0), TTFT, True, "met", id="ttft within"),
    pytest.param(
        ErrorStats(50, 0.14, 0.36, 0.003, 0.008, 1.0), TTFT, False, "NOT met", id="ttft p90 outside"
    ),
    # The old loophole: a 70 % error on a ~7 ms TPOT is 4.9 ms, under the old 5 ms absolute floor.
    pytest.param(
        ErrorStats(100, 0.70, 0.70, 0.0049, 0.0049, 1.7),
        TPOT,
        False,
        "NOT met",
        id="70 % of 7 ms, under 5 ms",
    ),
    pytest.param(ErrorStats(0, NAN, NAN, NAN, NAN, NAN), TPOT, False, "NOT met (no data)", id="no pairs"),
    pytest.param(
        ErrorStats(0, 0.0, 0.0, 0.0, 0.0, 1.0), TPOT, False, "NOT met (no data)", id="n=0 with zero errors"
    ),
    pytest.param(
        ErrorStats(10, NAN, NAN, NAN, NAN, NAN), TPOT, False, "NOT met (no data)", id="NaN quantiles"
    ),
]


@pytest.mark.parametrize(("stats", "targets", "met", "verdict"), CASES)
def test_met_and_verdict(stats: ErrorStats, targets: tuple[float, float], met: bool, verdict: str) -> None:
    assert stats.met(*targets) is met
    assert stats.verdict(*targets) == verdict


def test_error_stats_of_pairs() -> None:
    # Observed 10 ms each; predicted 10, 11, 12, 5 ms: APEs 0, 0.1, 0.2, 0.5; ratios 1, 1.1, 1.2, 0.5.
    e = error_stats([(0.010, 0.010), (0.011, 0.010), (0.012, 0.010), (0.005, 0.010)])
    assert e.n == 4
    assert e.median_ape == pytest.approx(0.15)
    assert e.p90_ape == pytest.approx(0.2 + 0.7 * 0.3)  # numpy's linear interpolation
    assert e.median_abs_s == pytest.approx(0.0015)
    assert e.median_ratio == pytest.approx(1.05)


def test_empty_data_is_not_met_and_says_so() -> None:
    e = error_stats([])
    assert e.n == 0
    assert not e.met(1.0, 1.0)  # whatever the targets
    assert e.verdict(*TPOT) == "NOT met (no data)"
    assert describe({"tpot": e}).endswith("NOT met (no data)")
    assert table_rows("fleet", {"tgi": {"tpot": e}})[0].endswith("| NOT met (no data) |")


def test_the_metric_picks_its_target() -> None:
    # 12 % median: within TTFT's 15 %, outside TPOT's 10 %.
    e = ErrorStats(30, 0.12, 0.2, 0.001, 0.002, 1.0)
    assert describe({"ttft_gateway": e}).endswith(": met")
    assert describe({"tpot": e}).endswith(": NOT met")
