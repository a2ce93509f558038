"""What a replica's measured forecast correction reports (``CorrectionLearner.state``): per
latency its factors, samples and residuals, per load regime its factor and spread. Immutable,
JSON-ready through ``dataclasses.asdict`` (the admin view's ``correction``, the metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CorrectionState", "LatencyState", "RegimeState", "Residuals"]


@dataclass(frozen=True, slots=True)
class Residuals:
    """Relative errors (``measured / forecast - 1``) of one latency over the residual window.

    ``before_*``: against the uncorrected forecast; ``after_*``: against the forecast as corrected
    when it was made. ``median``: signed (negative: forecasts were too high); ``p90_abs``: the
    90th percentile of the absolute error. ``None``: no sample in the window.
    """

    samples: int
    before_median: float | None
    before_p90_abs: float | None
    after_median: float | None
    after_p90_abs: float | None


@dataclass(frozen=True, slots=True)
class RegimeState:
    """One load regime's factor (``ttft_regime_label`` / ``regime_label``), samples kept and their
    decayed weight now, and a TTFT regime's spread: per ``SPREAD_QUANTILES`` entry, the factor by
    which that quantile lies above ``factor`` (``Correction.ttft_upper``; empty: none)."""

    regime: str
    factor: float
    samples: int
    weight: float
    upper: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class LatencyState:
    """One latency's (TTFT's or TPOT's) correction on one replica, for reports.

    ``factor``: the replica-wide factor (what a regime without samples of its batch bin would
    not use: reported for the overview). ``samples_total`` / ``out_of_range_total``: samples
    learned from and refused since start; ``samples`` / ``weight``: those kept now and their
    decayed weight (effective samples). ``regimes``: each regime with samples kept.
    """

    factor: float
    samples_total: int
    out_of_range_total: int
    samples: int
    weight: float
    regimes: tuple[RegimeState, ...]
    residuals: Residuals


@dataclass(frozen=True, slots=True)
class CorrectionState:
    """A replica's correction (``CorrectionLearner.state``): the knobs that matter and each latency's."""

    enabled: bool
    half_life_s: float
    ttft: LatencyState
    tpot: LatencyState
