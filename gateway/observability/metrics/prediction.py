"""Predictions against what happened, per replica: observed and forecast TTFT/TPOT from dispatch,
their relative errors, Sluice's own overhead before dispatch, and each replica's step-model fit
read at scrape time.

``PredictionMetrics.observe`` runs once per finished request (after ``RequestMetrics``);
``StepModelCollector`` asks ``FitSource`` for each live replica's ``FitReport`` when /metrics is
scraped, and yields no samples for a replica without one; ``CorrectionCollector`` asks
``CorrectionSource`` for each live replica's measured forecast correction
(``predictor.correction``) the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observability.metrics.buckets import (
    ABS_ERROR_BUCKETS,
    ERROR_BUCKETS,
    OVERHEAD_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from gateway.observability.metrics.children import Children
from gateway.observability.metrics.outcomes import (
    number_field,
    observed_tpot_s,
    proxy_overhead_s,
    relative_error,
)
from gateway.observability.outcome import RequestOutcome
from predictor import FEATURE_NAMES, FitReport
from predictor.correction import SPREAD_QUANTILES, CorrectionState

#: A replica's step-model fit by replica name; ``None`` when it has none.
FitSource = Callable[[str], FitReport | None]
#: A replica's forecast correction by replica name at a time (the clock's seconds).
CorrectionSource = Callable[[str, float], CorrectionState | None]


class PredictionMetrics:
    """The per-replica prediction series and the overhead histogram, registered in ``registry``
    at construction (in exposition order)."""

    def __init__(self, registry: CollectorRegistry, children: Children) -> None:
        self._children = children
        r = registry
        # Engine side: from dispatch.
        self.observed_ttft = Histogram(
            "sluice_observed_ttft_seconds",
            "Time to first token from dispatch to the replica, streamed requests.",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "sluice_predicted_ttft_seconds",
            "Forecast time to first token from dispatch, for the replica chosen.",
            ["replica"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.observed_tpot = Histogram(
            "sluice_observed_tpot_seconds",
            "Time per output token observed on the replica, streamed requests with >= 2 tokens.",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.predicted_tpot = Histogram(
            "sluice_predicted_tpot_seconds",
            "Forecast time per output token, for the replica chosen.",
            ["replica"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prediction_error = Histogram(
            "sluice_prediction_error_ratio",
            "Signed relative prediction error (predicted - observed) / observed, by replica and kind.",
            ["replica", "kind"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.prediction_abs_error = Histogram(
            "sluice_prediction_abs_error_ratio",
            "Absolute relative prediction error |predicted - observed| / observed, by replica and kind.",
            ["replica", "kind"],
            buckets=ABS_ERROR_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "sluice_prompt_cached_tokens_total",
            "Prompt tokens of requests sent to a replica that admission expected to hit its prefix "
            "cache (source=expected) and that its answers reported as hits (source=reported), by "
            "replica. Over sluice_prompt_tokens_total: the hit rate.",
            ["replica", "source"],
            registry=r,
        )
        self.proxy_overhead = Histogram(
            "sluice_proxy_overhead_seconds",
            "Seconds in Sluice before dispatch, queue wait excluded (body, parse, admission, routing).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )

    def observe(self, outcome: RequestOutcome) -> None:
        """One finished request: its replica's predictions against observations (when it was
        dispatched) and Sluice's overhead before dispatch."""
        if outcome.replica is not None:
            replica = outcome.replica
            ttft = (number_field(outcome, "predicted_ttft_s"), outcome.ttft_s)
            tpot = (number_field(outcome, "predicted_tpot_s"), observed_tpot_s(outcome))
            self._observe_pair(replica, "ttft", *ttft, self.predicted_ttft, self.observed_ttft)
            self._observe_pair(replica, "tpot", *tpot, self.predicted_tpot, self.observed_tpot)
            expected = number_field(outcome, "expected_cached_tokens")
            if expected:
                self._children.counter(self.cached_tokens, replica, "expected")(max(0.0, expected))
            reported = number_field(outcome, "cached_tokens")
            if reported:
                self._children.counter(self.cached_tokens, replica, "reported")(max(0.0, reported))
        overhead = proxy_overhead_s(outcome)
        if overhead is not None:
            self.proxy_overhead.observe(overhead)

    def _observe_pair(
        self,
        replica: str,
        kind: str,
        predicted: float | None,
        observed: float | None,
        predicted_hist: Histogram,
        observed_hist: Histogram,
    ) -> None:
        observer = self._children.observer
        if observed is not None:
            observer(observed_hist, replica)(max(0.0, observed))
        if predicted is None:
            return
        observer(predicted_hist, replica)(max(0.0, predicted))
        error = None if observed is None else relative_error(predicted, observed)
        if error is not None:
            observer(self.prediction_error, replica, kind)(error)
            observer(self.prediction_abs_error, replica, kind)(abs(error))


class StepModelCollector(Collector):
    """Each live replica's step-model fit, read from ``source`` at every scrape; ``names`` lists
    the live replicas. No samples while ``source`` is ``None``."""

    def __init__(self, names: Callable[[], list[str]]) -> None:
        self._names = names
        self.source: FitSource | None = None

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily
    ]:
        return (
            GaugeMetricFamily(
                "sluice_step_model_coefficient_seconds",
                "Step-model coefficient, seconds per unit of its term, for the model in use and the prior.",
                labels=["replica", "term", "model"],
            ),
            GaugeMetricFamily(
                "sluice_step_model_fit_error_ratio",
                "Median absolute relative error of step times over recent observations (fit, prior).",
                labels=["replica", "model"],
            ),
            GaugeMetricFamily(
                "sluice_step_model_valid", "1 when the replica's step model can forecast.", labels=["replica"]
            ),
            GaugeMetricFamily(
                "sluice_step_model_effective_observations",
                "Step-time observations the fit holds now (sum of forgetting weights).",
                labels=["replica"],
            ),
            CounterMetricFamily(
                "sluice_step_model_observations",
                "Step-time observations accepted by the fit since start.",
                labels=["replica"],
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        coefficient, error, valid, effective, accepted = self._families()
        source = self.source
        for name in self._names() if source is not None else []:
            report = source(name) if source is not None else None
            if report is None:
                continue
            for term, value in zip(FEATURE_NAMES, report.params.coefficients(), strict=True):
                coefficient.add_metric([name, term, "in_use"], value)
            if report.prior is not None:
                for term, value in zip(FEATURE_NAMES, report.prior.coefficients(), strict=True):
                    coefficient.add_metric([name, term, "prior"], value)
            if report.mdape is not None:
                error.add_metric([name, "fit"], report.mdape)
            if report.prior_mdape is not None:
                error.add_metric([name, "prior"], report.prior_mdape)
            valid.add_metric([name], 1.0 if report.valid else 0.0)
            effective.add_metric([name], report.effective_observations)
            accepted.add_metric([name], float(report.observations_total))
        yield from (coefficient, error, valid, effective)
        # A counter family is named without ``_total``; it is exposed with it.
        yield accepted


class CorrectionCollector(Collector):
    """Each live replica's measured forecast correction (``predictor.correction``), read from
    ``source`` at every scrape at ``clock()``; ``names`` lists the live replicas. No samples while
    ``source`` is ``None``.

    ``sluice_forecast_correction_factor{replica, kind, regime}``: the factor admission multiplies
    the engine's forecast by (``regime="all"``: the replica-wide one; else each load regime with
    samples). ``..._samples_total``: samples learned from since start; ``..._weight``: the samples
    kept, as effective samples (decayed); ``sluice_forecast_residual_ratio{replica, kind,
    forecast, stat}``: the relative error (measured / forecast - 1) of the requests that finished in
    the residual window, against the forecast ``uncorrected`` or as ``corrected`` when it was made,
    as its signed ``median`` and the ``p90_abs`` of its absolute value.
    ``sluice_forecast_correction_spread{replica, regime, quantile}``: per TTFT regime with samples,
    the factor by which that quantile of what was measured lies above the median factor (what
    admission multiplies a class's TTFT by at its attainment target).
    """

    def __init__(self, names: Callable[[], list[str]], clock: Callable[[], float]) -> None:
        self._names = names
        self._clock = clock
        self.source: CorrectionSource | None = None

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily, CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
    ]:
        return (
            GaugeMetricFamily(
                "sluice_forecast_correction_factor",
                "Factor admission multiplies the replica's engine forecast by (measured / forecast).",
                labels=["replica", "kind", "regime"],
            ),
            CounterMetricFamily(
                "sluice_forecast_correction_samples",
                "Finished requests the replica's forecast correction learned from since start.",
                labels=["replica", "kind"],
            ),
            GaugeMetricFamily(
                "sluice_forecast_correction_weight",
                "Samples the correction holds now, as effective samples (decayed by their age).",
                labels=["replica", "kind"],
            ),
            GaugeMetricFamily(
                "sluice_forecast_residual_ratio",
                "Relative error measured/forecast - 1 of recent requests, uncorrected or as corrected.",
                labels=["replica", "kind", "forecast", "stat"],
            ),
            GaugeMetricFamily(
                "sluice_forecast_correction_spread",
                "Factor by which a quantile of measured / forecast TTFT lies above the median, per regime.",
                labels=["replica", "regime", "quantile"],
            ),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterator[Metric]:
        factor, samples, weight, residual, spread = self._families()
        source = self.source
        now = self._clock()
        for name in self._names() if source is not None else []:
            state = source(name, now) if source is not None else None
            if state is None or not state.enabled:
                continue
            for kind, latency in (("ttft", state.ttft), ("tpot", state.tpot)):
                factor.add_metric([name, kind, "all"], latency.factor)
                for regime in latency.regimes:
                    factor.add_metric([name, kind, regime.regime], regime.factor)
                    for q, upper in zip(SPREAD_QUANTILES, regime.upper, strict=False):
                        spread.add_metric([name, regime.regime, f"{q:g}"], upper)
                samples.add_metric([name, kind], float(latency.samples_total))
                weight.add_metric([name, kind], latency.weight)
                res = latency.residuals
                for forecast, median, p90 in (
                    ("uncorrected", res.before_median, res.before_p90_abs),
                    ("corrected", res.after_median, res.after_p90_abs),
                ):
                    if median is not None:
                        residual.add_metric([name, kind, forecast, "median"], median)
                    if p90 is not None:
                        residual.add_metric([name, kind, forecast, "p90_abs"], p90)
        yield from (factor, samples, weight, residual, spread)
